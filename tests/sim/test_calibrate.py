"""Calibration (`groupflow sim --from-run`): a scenario fitted to a run's trace, whose simulation
reproduces the run. Round trips on simulated runs, whose true models are known; a real trainer
run; refusals; and the fitted scenario written as TOML that reads back.

Seeded bugs, each caught by the test named after it: a teacher fit that counts groups, not rows,
per call; batches read from the model's state before the dispatch, not after; a teacher fit
blind to the calls' tokens; the tokens' spread left in a rollout's own; token terms fitted to
noise. Seeded wrong fits
(a sync too long, teachers too slow) show the attribution naming the term that is wrong; idle
syncs pooled with the others lose the cost of each, and syncs fitted apart on noise err;
syncs that cost alike with rollouts in flight or without are noted as if they did not;
candidates compared before their drains; lockstep read never, or always; a waiting sync
noted as one cost for both.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.cli import main
from groupflow.impl._teachers import PROBE_FILE, ProbeCall, write_probe
from groupflow.model.errors import TraceCorrupt
from groupflow.sim import calibrate as calibrate_module
from groupflow.sim.calibrate import (
    attribution_table,
    calibrate,
    compare,
    simulated_terms,
    variant_of,
)
from groupflow.sim.engines import EngineModel, WeightSyncModel
from groupflow.sim.run import INLINE, PUMP_DEMAND, simulate
from groupflow.sim.scenario import load_scenario, parse_scenario, scenario_toml, shipped_scenarios

KNOWN = """
name = "known"
steps = 40
[pipeline]
prompts_per_step = 8
num_generations_per_prompt = 4
max_inflight_prompts = 8
max_buffered_groups = 16
[scoring]
max_batch_groups = 7
flush_after_s = 2.0
[generation]
median_s = 12.0
sigma = 0.3
min_s = 3.0
[teachers.teacher]
fixed_s = 0.85
per_row_s = 0.05
[train]
step_s = 8.0
"""


@pytest.fixture(scope="module")
def known_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    trace = tmp_path_factory.mktemp("known") / "trace.jsonl"
    result = simulate(parse_scenario(KNOWN), PUMP_DEMAND, trace=trace)
    return trace, result


def test_a_simulated_run_is_fitted_back(known_trace: tuple[Path, Any]) -> None:
    trace, truth = known_trace
    fit = calibrate(trace)
    teacher = fit.scenario.teachers["teacher"]
    assert teacher.fixed_s == pytest.approx(0.85, rel=1e-3)
    assert teacher.per_row_s == pytest.approx(0.05, rel=1e-3)
    assert teacher.per_token_s == 0.0  # two tokens a row: tokens tell nothing rows do not
    generation = fit.scenario.generation
    assert (generation.tokens, generation.tokens_sigma, generation.token_share) == (8, 0, 0)
    assert fit.scenario.train_step_s == pytest.approx(8.0, rel=1e-3)
    assert fit.scenario.engines.batching  # rollouts overlapped freely: the parallel law won
    assert fit.scenario.generation.median_s == pytest.approx(12.0, rel=0.15)
    assert fit.observed.s_per_step == pytest.approx(truth.s_per_step, rel=1e-3)
    assert fit.observed.calls_per_step == pytest.approx(truth.calls_per_step)
    again = simulate(fit.scenario, variant_of(fit.scenario.pipeline))
    for what, real, sim, error in compare(fit.observed, again):
        if math.isfinite(error):
            assert abs(error) < 0.10, (what, real, sim)


def test_seeded_bug_teacher_fit_counts_groups_is_caught(
    known_trace: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = calibrate_module._Walk.on_action

    def by_groups(self: Any, data: Any, before: Any, after: Any) -> None:
        original(self, data, before, after)
        if data["kind"] == "scored":
            rows, seconds = self.calls[data["lane"]][-1]
            self.calls[data["lane"]][-1] = (rows // self.generations, seconds)

    monkeypatch.setattr(calibrate_module._Walk, "on_action", by_groups)
    fit = calibrate(known_trace[0])
    with pytest.raises(AssertionError):
        assert fit.scenario.teachers["teacher"].per_row_s == pytest.approx(0.05, rel=1e-3)


def test_seeded_bug_batches_read_before_the_dispatch_is_caught(
    known_trace: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = calibrate_module._Walk.on_action

    def before_dispatch(self: Any, data: Any, before: Any, after: Any) -> None:
        original(self, data, before, after if data["kind"] != "dispatch" else _padded(before))

    def _padded(state: Any) -> Any:  # the batch the queue held in flight before: none or old
        inflight = tuple(q or ((0,),) for q in state.inflight)
        return state._replace(inflight=inflight)

    monkeypatch.setattr(calibrate_module._Walk, "on_action", before_dispatch)
    fit = calibrate(known_trace[0])
    with pytest.raises(AssertionError):
        assert fit.scenario.teachers["teacher"].fixed_s == pytest.approx(0.85, rel=1e-3)


TOKENS = (
    KNOWN.replace('name = "known"', 'name = "tokens"')
    .replace("min_s = 3.0", "min_s = 3.0\ntokens = 400\ntokens_sigma = 0.5\ntoken_share = 0.8")
    .replace(
        "fixed_s = 0.85\nper_row_s = 0.05", "fixed_s = 0.3\nper_row_s = 0.01\nper_token_s = 5e-4"
    )
    .replace("sigma = 0.3", "sigma = 0.2")
)
"""Groups of 400 tokens (median) that vary, four fifths of a rollout's time growing with them,
and a teacher whose calls cost per token besides their rows."""


@pytest.fixture(scope="module")
def tokens_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("tokens") / "trace.jsonl"
    simulate(parse_scenario(TOKENS), PUMP_DEMAND, trace=trace)
    return trace


def test_time_against_tokens_is_fitted_back(tokens_trace: Path) -> None:
    """The commits' tokens give the groups' lognormal and the share of a rollout's time that
    grows with them; the calls' tokens give the teacher's cost per token apart from per row."""
    fit = calibrate(tokens_trace)
    teacher = fit.scenario.teachers["teacher"]
    assert teacher.fixed_s == pytest.approx(0.3, rel=1e-3)
    assert teacher.per_row_s == pytest.approx(0.01, rel=1e-3)
    assert teacher.per_token_s == pytest.approx(5e-4, rel=1e-3)
    generation = fit.scenario.generation
    assert generation.tokens == pytest.approx(400, rel=0.08)  # 320 groups drawn
    assert generation.tokens_sigma == pytest.approx(0.5, rel=0.1)
    assert generation.token_share == pytest.approx(0.8, abs=0.08)
    assert generation.sigma == pytest.approx(0.2, abs=0.05)  # the tokens' spread left out
    assert any(note.startswith("tokens: a group carried") for note in fit.notes)
    again = simulate(fit.scenario, variant_of(fit.scenario.pipeline))
    for what, real, sim, error in compare(fit.observed, again):
        if math.isfinite(error):
            assert abs(error) < 0.10, (what, real, sim)


def test_the_simulation_carries_a_groups_tokens_to_its_teacher_call(tokens_trace: Path) -> None:
    """The rows of a group hold its tokens, the commit line records them, and a call costs
    its rows' and tokens' seconds."""
    lines = [json.loads(line) for line in tokens_trace.read_text().splitlines()]
    tokens = {a["ordinal"]: a["tokens"] for a in lines if a.get("kind") == "commit"}
    assert len(set(tokens.values())) > len(tokens) // 2  # drawn, not one size
    model = parse_scenario(TOKENS).generation
    assert tokens == {o: model.tokens_of(0, o) for o in tokens}
    _, _, walk = calibrate_module._walked(tokens_trace)
    calls = list(zip(walk.calls[0], walk.call_tokens[0], strict=True))
    assert len(calls) > 100
    for (rows, seconds), carried in calls:
        assert seconds == pytest.approx(0.3 + 0.01 * rows + 5e-4 * (carried or 0), rel=1e-9)


def test_a_trace_without_tokens_fits_none(tokens_trace: Path, tmp_path: Path) -> None:
    """A trace whose commits say no tokens (rows without token ids): no tokens drawn, and no
    cost per token, which the simulation would have no tokens to charge."""
    bare = tmp_path / "trace.jsonl"
    lines = [json.loads(line) for line in tokens_trace.read_text().splitlines()]
    bare.write_text(
        "".join(json.dumps({k: v for k, v in a.items() if k != "tokens"}) + "\n" for a in lines)
    )
    fit = calibrate(bare)
    assert fit.scenario.generation.tokens == 0.0
    assert fit.scenario.teachers["teacher"].per_token_s == 0.0
    assert not any(note.startswith("tokens") for note in fit.notes)


@pytest.mark.parametrize("said", [0, -3, True, 2.5, "12", None])
def test_a_commit_that_says_no_usable_tokens_counts_none(said: object) -> None:
    """A commit of rows without token ids, or a line that does not hold a count: its rollout
    carries no tokens (a zero would divide its time by nothing)."""
    walk = calibrate_module._Walk(generations=4)
    unread: Any = None  # admits and commits are read off their lines, not the states
    admit = {"incarnation": 0, "kind": "admit", "ordinal": 0, "time": 0.0}
    walk.on_action(admit, unread, unread)
    line = {"incarnation": 0, "kind": "commit", "ordinal": 0, "time": 1.0, "tokens": said}
    walk.on_action(line, unread, unread)
    assert walk.interval_tokens == [None] and walk.tokens == {}


def test_tokens_that_drive_no_time_are_not_read_into_it(tmp_path: Path) -> None:
    """Groups whose tokens vary but cost nothing: no share of a rollout's time, and no cost
    per token of a call, is fitted to the noise (each term must explain the times)."""
    text = TOKENS.replace("token_share = 0.8", "token_share = 0.0").replace(
        "per_token_s = 5e-4", "per_token_s = 0.0\nspread = [0.8, 1.2]"
    )
    for seed in range(4):  # noise leans one way or the other from one draw to the next
        trace = tmp_path / f"trace-{seed}.jsonl"
        simulate(parse_scenario(text), PUMP_DEMAND, trace=trace, seed=seed)
        fit = calibrate(trace)
        assert fit.scenario.generation.tokens == pytest.approx(400, rel=0.08)
        assert fit.scenario.generation.token_share == 0.0
        assert fit.scenario.teachers["teacher"].per_token_s == 0.0


def test_seeded_bug_token_terms_fitted_to_noise_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate_module, "_explains", lambda columns, extra, y: True)
    with pytest.raises(AssertionError):
        test_tokens_that_drive_no_time_are_not_read_into_it(tmp_path)


def test_seeded_bug_teacher_tokens_ignored_is_caught(
    tokens_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate_module, "_tokens_apart", lambda points, tokens: False)
    with pytest.raises(AssertionError):
        test_time_against_tokens_is_fitted_back(tokens_trace)


def test_seeded_bug_the_tokens_spread_counted_twice_is_caught(
    tokens_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bases kept as they are: the simulation draws the tokens' spread again on top."""
    monkeypatch.setattr(calibrate_module._Tokens, "factor", lambda self, tokens: 1.0)
    with pytest.raises(AssertionError):
        test_time_against_tokens_is_fitted_back(tokens_trace)


def test_a_run_on_one_engine_in_turn_is_fitted_as_one(tmp_path: Path) -> None:
    text = (
        KNOWN.replace("[train]", "[engines]\nbatching = false\n\n[train]")
        .replace("median_s = 12.0", "median_s = 1.0")
        .replace("min_s = 3.0", "min_s = 0.2")
    )
    trace = tmp_path / "trace.jsonl"
    truth = simulate(parse_scenario(text), PUMP_DEMAND, trace=trace)
    fit = calibrate(trace)
    assert not fit.scenario.engines.batching
    again = simulate(fit.scenario, variant_of(fit.scenario.pipeline))
    assert again.s_per_step == pytest.approx(truth.s_per_step, rel=0.10)


def test_a_trace_the_model_rejects_is_not_fitted(
    known_trace: tuple[Path, Any], tmp_path: Path
) -> None:
    lines = known_trace[0].read_text().splitlines()
    bad = tmp_path / "trace.jsonl"
    # drop a commit: the model then refuses the dispatch that takes that group
    i = next(i for i, line in enumerate(lines) if '"kind":"commit"' in line)
    bad.write_text("\n".join(lines[:i] + lines[i + 1 :]) + "\n")
    with pytest.raises(TraceCorrupt, match=rf"{bad}: line \d+: cannot fit this trace \(REJECTED"):
        calibrate(bad)


def test_a_restart_that_died_after_its_header_is_not_fitted(
    known_trace: tuple[Path, Any], tmp_path: Path
) -> None:
    lines = known_trace[0].read_text().splitlines()
    header = json.loads(lines[0])
    cut = tmp_path / "trace.jsonl"
    cut.write_text("\n".join([*lines, json.dumps({**header, "incarnation": 1})]) + "\n")
    with pytest.raises(TraceCorrupt, match=r"cannot fit .*INCOMPLETE.*incarnation 1's header"):
        calibrate(cut)


def _metrics_beside(trace: Path, tmp_path: Path, text: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trace, run / "trace.jsonl")
    (run / "metrics.jsonl").write_text(text)
    return run


def test_a_metrics_file_that_cannot_be_read_is_refused_naming_its_line(
    known_trace: tuple[Path, Any], tmp_path: Path
) -> None:
    run = _metrics_beside(known_trace[0], tmp_path, '{"step": 0, "sync_s": 0.5}\nnot json\n')
    with pytest.raises(TraceCorrupt, match=r"metrics.jsonl: line 2 is not a step's record"):
        calibrate(run)


def test_a_metrics_line_cut_short_by_a_crash_is_left_out(
    known_trace: tuple[Path, Any], tmp_path: Path
) -> None:
    run = _metrics_beside(known_trace[0], tmp_path, '{"step": 0, "sync_s": 0.5}\n{"step": 1, "sy')
    sync = calibrate(run).scenario.weight_sync
    assert sync is not None and sync.fixed_s == pytest.approx(0.5)


@pytest.mark.parametrize("name", shipped_scenarios())
def test_every_shipped_scenario_reads_back_from_its_toml(name: str) -> None:
    scenario = load_scenario(name)
    assert parse_scenario(scenario_toml(scenario)) == scenario


def test_the_cli_writes_the_fitted_scenario_and_the_comparison(
    known_trace: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "fitted.toml"
    code = main(["sim", "--from-run", str(known_trace[0]), "--write", str(target)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"wrote {target}" in out and "seconds per step" in out and "error" in out
    assert parse_scenario(target.read_text()).teachers["teacher"].fixed_s == pytest.approx(
        0.85, rel=1e-3
    )


def _seeds_row(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[str, list[str], list[str]]:
    """What `--from-run --seeds 3 --seed 4` prints, its seconds-per-step row, and the row
    three simulations of their own (seeds 4 to 6) give: the run's figure against their mean,
    and each error's range over them beside it."""
    argv = ["sim", "--from-run", str(trace), "--write", str(tmp_path / "fitted.toml")]
    assert main([*argv, "--seeds", "3", "--seed", "4", "--design", "both"]) == 0
    out = capsys.readouterr().out
    fit = calibrate(trace)
    alone = [simulated_terms(fit.scenario, PUMP_DEMAND, seed=s)[0] for s in (4, 5, 6)]
    errors = [compare(fit.observed, r)[0][3] for r in alone]
    assert min(errors) < max(errors)  # the seeds differ, so a range shows them apart
    mean = sum(r.s_per_step for r in alone) / 3
    row = next(line for line in out.splitlines() if line.startswith("seconds per step"))
    expected = [
        f"{mean:.4g}",
        f"{mean / fit.observed.s_per_step - 1:+.1%}",
        f"{min(errors):+.1%}",
        "to",
        f"{max(errors):+.1%}",
    ]
    return out, row.split()[4:], expected


def test_the_cli_compares_the_run_with_the_mean_over_seeds(
    known_trace: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, shown, expected = _seeds_row(known_trace[0], tmp_path, capsys)
    assert shown == expected
    assert "the mean of seeds 4 to 6" in out and "what if" in out and "seeds 4 to 6" in out


def test_seeded_bug_the_first_seed_compared_alone_is_caught(
    known_trace: tuple[Path, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A seeded bug: every simulation of `--seeds` runs the first seed."""
    from groupflow.cli import _sim

    monkeypatch.setattr(_sim, "_seeds", lambda args: [args.seed] * args.seeds)
    _, shown, expected = _seeds_row(known_trace[0], tmp_path, capsys)
    assert shown != expected


def _fit_as_json(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    """What `--from-run --json --seeds 2 --seed 4 --design both` prints, parsed strictly
    (JSON has no NaN): stdout holds the JSON alone."""
    argv = ["sim", "--from-run", str(trace), "--write", str(tmp_path / "fitted.toml")]
    assert main([*argv, "--json", "--seeds", "2", "--seed", "4", "--design", "both"]) == 0
    out, err = capsys.readouterr()
    assert "wrote" in err

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(out, parse_constant=refuse)


def test_the_cli_gives_the_fit_as_json(
    known_trace: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fit's notes, each figure of the run against the mean of its simulations with each
    seed's error, and the what-if; a figure the run cannot be compared on (a pump run holds
    no permit-seconds in scoring) is null."""
    got = _fit_as_json(known_trace[0], tmp_path, capsys)
    fit = calibrate(known_trace[0])
    alone = [simulated_terms(fit.scenario, PUMP_DEMAND, seed=s)[0] for s in (4, 5)]
    assert got["notes"] == list(fit.notes)
    assert (got["seeds"], got["run_steps"]) == ([4, 5], fit.observed.steps)
    rows = {row["figure"]: row for row in got["compared"]}
    seconds = rows["s_per_step"]
    assert seconds["run"] == pytest.approx(fit.observed.s_per_step, abs=1e-6)
    mean = statistics.fmean(r.s_per_step for r in alone)
    assert seconds["simulated"] == pytest.approx(mean, abs=1e-6)
    errors = [compare(fit.observed, r)[0][3] for r in alone]
    assert seconds["errors"] == pytest.approx(errors, abs=1e-6)
    assert rows["permit_s_per_step"]["error"] is None
    assert sorted((r["design"], r["seed"]) for r in got["what_if"]) == sorted(
        (design, seed) for design in ("inline", "pump (demand)") for seed in (4, 5)
    )


def test_seeded_bug_a_nan_in_the_fit_json_is_caught(
    known_trace: tuple[Path, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A seeded bug: a figure that cannot be compared is written as NaN, which is no JSON."""
    from groupflow.cli import _sim

    monkeypatch.setattr(_sim, "json_number", lambda value: round(value, 6))
    with pytest.raises(ValueError, match="NaN is not JSON"):
        _fit_as_json(known_trace[0], tmp_path, capsys)


def test_the_cli_refuses_a_what_if_of_no_design_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run with a verifier, asked what the inline baseline (which runs none) would do."""
    trace = tmp_path / "verifier.jsonl"
    assert (
        main(
            [
                "sim",
                "--scenario",
                "verifier",
                "--design",
                "pump",
                "--steps",
                "6",
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    capsys.readouterr()
    argv = ["sim", "--from-run", str(trace), "--write", str(tmp_path / "fitted.toml")]
    assert main([*argv, "--design", "inline"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[verifier]" in err[0] and "'inline'" in err[0]


def test_the_cli_refuses_a_missing_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sim", "--from-run", str(tmp_path / "nothing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nothing" in err[0]


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 30-step trainer run, with a checkpoint every 10 steps (written in a thread, as
    the trainer does)."""
    pytest.importorskip("torch", reason="the trainer needs torch (pip install '.[train]')")
    from groupflow.impl import TorchTeacher
    from groupflow.impl._trainer import RunFolder, TrainConfig
    from groupflow.impl._trainer._provision import DomainTeacher
    from groupflow.impl._trainer._run import train
    from groupflow.impl._trainer._student import new_student, student_config

    config = TrainConfig().evolve(
        steps=30,
        prompts_per_step=2,
        num_generations_per_prompt=2,
        max_inflight_prompts=4,
        max_buffered_groups=4,
        max_batch_groups=2,
        checkpoints={"every_steps": 10},
        eval_prompts=4,
        d_model=32,
        n_layers=1,
    )
    assert config.pipeline_config().checkpoints is not None
    cfg = student_config(d_model=32, n_layers=1)
    teachers = {
        d: DomainTeacher(f"{d}-teacher", TorchTeacher(new_student(cfg, seed=7 + i), device="cpu"))
        for i, d in enumerate(config.domains)
    }
    run = tmp_path_factory.mktemp("trainer") / "run"

    async def go() -> None:
        with trio.fail_after(300):
            await train(
                RunFolder.new(run, config),
                teachers=teachers,
                device="cpu",
                progress=None,
                say=lambda s: None,
                plot=False,
            )

    trio.run(go)
    return run


def _check_fit(run: Path) -> None:
    """The fit of a run that checkpointed simulates to its end without a stall, near the run's
    seconds per step, and twice the same."""
    fit = calibrate(run)
    assert set(fit.scenario.teachers) == {"count-teacher", "reverse-teacher"}
    assert fit.scenario.weight_sync is not None and fit.scenario.weight_sync.fixed_s > 0
    assert fit.observed.steps == 30 and fit.observed.s_per_step > 0
    result = simulate(fit.scenario, variant_of(fit.scenario.pipeline))
    assert result.outcome == "ok" and result.steps == 30 and result.stalls == 0
    seconds_per_step = compare(fit.observed, result)[0]
    assert abs(seconds_per_step[3]) < 0.5, seconds_per_step
    again = simulate(calibrate(run).scenario, variant_of(fit.scenario.pipeline))
    assert attrs.evolve(again, wall_s=0.0) == attrs.evolve(result, wall_s=0.0)
    assert again.spans == result.spans


@pytest.mark.timeout(600)  # a real trainer run, on a loaded machine
def test_a_trainer_run_that_checkpointed_is_fitted(trainer_run: Path) -> None:
    _check_fit(trainer_run)


def _bug_checkpoints_written_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator writes checkpoints as the fitted config says: in a thread, which takes
    real time the virtual clock jumps past."""
    from groupflow.sim import run as run_module

    real = run_module._config

    def as_the_run(*args: Any, **kwargs: Any) -> Any:
        config = real(*args, **kwargs)
        assert config.checkpoints is not None
        return attrs.evolve(
            config, checkpoints=attrs.evolve(config.checkpoints, write_in_thread=True)
        )

    monkeypatch.setattr(run_module, "_config", as_the_run)


@pytest.mark.timeout(600)
def test_seeded_bug_checkpoints_written_in_a_thread_is_caught(
    trainer_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bug_checkpoints_written_in_a_thread(monkeypatch)
    with pytest.raises(AssertionError):
        _check_fit(trainer_run)


@pytest.mark.timeout(600)
def test_the_cli_gives_the_same_fit_and_comparison_twice(
    trainer_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fit, its comparison and the what-if of both designs, byte for byte: how fast the
    simulator ran (real time) goes to stderr."""
    outputs = []
    for i in range(2):
        target = tmp_path / f"fitted-{i}.toml"
        argv = ["sim", "--from-run", str(trainer_run), "--write", str(target), "--design", "both"]
        assert main(argv) == 0
        out, err = capsys.readouterr()
        outputs.append((out.replace(str(target), "FILE"), target.read_bytes()))
        assert "steps simulated in" in err
    assert outputs[0] == outputs[1]
    assert "seconds per step" in outputs[0][0] and "what if" in outputs[0][0]


@pytest.mark.timeout(600)
def test_the_cli_refuses_a_fit_whose_simulation_stalls(
    trainer_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fitted simulation that stalls where the run did not is no prediction: no table, one
    line on stderr naming the stall and the fitted file, exit status 1."""
    _bug_checkpoints_written_in_a_thread(monkeypatch)
    target = tmp_path / "fitted.toml"
    code = main(["sim", "--from-run", str(trainer_run), "--write", str(target)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "against its simulation" not in out
    assert "predicts nothing" in err and "stalled" in err and str(target) in err


def test_a_run_its_user_stopped_is_fitted(tmp_path: Path) -> None:
    """INCOMPLETE by design (resume it to finish), and a fair record of how the run went."""
    from groupflow.sim.verify.replay import INCOMPLETE, replay
    from tests.traced import traced_run

    run = trio.run(
        functools.partial(traced_run, tmp_path, stop_at=10.0),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert replay(run.trace).verdict == INCOMPLETE
    fit = calibrate(run.trace)
    assert fit.scenario.steps > 0


def _walk_with(rollouts: list[tuple[float, float]]) -> Any:
    walk = calibrate_module._Walk(generations=4)
    walk.rollouts.extend(rollouts)
    return walk


def test_a_batching_engine_is_fitted_from_times_against_load() -> None:
    """Rollouts that took longer the more sequences shared the engine: the slowdown curve and
    the time alone come back (4 sequences a rollout, up to 8 rollouts: 32 sequences)."""
    truth = EngineModel(slowdown=((1.0, 1.0), (32.0, 3.0)))
    loads = [1.0, 2.0, 3.5, 5.0, 6.0, 8.0] * 3
    rollouts = [(2.0 * (1 + (3.0 - 1) * (c * 4 - 1) / 31), c) for c in loads]
    generation, engines = calibrate_module._batching(_walk_with(rollouts), 4, 8)
    assert engines.batching and engines.engines == 1
    assert engines.factor(32) == pytest.approx(truth.factor(32), rel=1e-3)
    assert engines.factor(16) == pytest.approx(truth.factor(16), rel=1e-3)
    assert generation.sigma == pytest.approx(0.0, abs=1e-6)
    assert generation.median_s == pytest.approx(2.0, rel=1e-3)


def test_seeded_bug_batching_load_counts_rollouts_not_sequences_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = calibrate_module._batching
    monkeypatch.setattr(
        calibrate_module, "_batching", lambda walk, generations, inflight: real(walk, 1, inflight)
    )
    with pytest.raises(AssertionError):
        test_a_batching_engine_is_fitted_from_times_against_load()


def _sync_walk(waits: bool) -> Any:
    """Four steps whose syncs (0.5 s each, ending at t = 10, 20, 30, 40) each meet two rollouts
    in flight: ending 0.1 s and 0.3 s into the sync when the sync waits for them, after it
    when it freezes them."""
    walk = calibrate_module._Walk(generations=4)
    for step in range(4):
        end = 10.0 * (step + 1)
        walk.trained_at[step] = (0, end)
        for into in (0.1, 0.3) if waits else (0.7, 0.9):
            walk.intervals.append((0, end - 2.0, end - 0.5 + into))
    return walk


@pytest.mark.parametrize("waits", [True, False])
def test_a_sync_that_waits_for_rollouts_is_told_from_one_that_freezes_them(waits: bool) -> None:
    ways = dict(calibrate_module._weight_sync(_sync_walk(waits), dict.fromkeys(range(4), 0.5)))
    assert ways["interrupt"].fixed_s == pytest.approx(0.5)
    if waits:
        assert ways["wait"].mode == "wait"
        assert ways["wait"].fixed_s == pytest.approx(0.2)  # after the last rollout: 0.5 - 0.3
    else:
        assert "wait" not in ways


def _syncs_meeting(busy_s: float, idle_s: float) -> tuple[Any, dict[int, float]]:
    """Forty steps whose syncs end at t = 10, 20, ...: the even ones meet a rollout in flight
    and take about `busy_s`, the odd ones meet none and take about `idle_s`."""
    walk = calibrate_module._Walk(generations=4)
    syncs = {}
    for step in range(40):
        end = 10.0 * (step + 1)
        walk.trained_at[step] = (0, end)
        met = step % 2 == 0
        syncs[step] = (busy_s if met else idle_s) * (1 + 0.01 * (step % 5))
        if met:
            walk.intervals.append((0, end - syncs[step] - 1.0, end))
    return walk, syncs


_FREEZES = WeightSyncModel(fixed_s=0.5, mode="interrupt")


def test_syncs_that_cost_otherwise_with_rollouts_in_flight_are_noted() -> None:
    """A fit that keeps one cost for every sync that freezes the rollouts says where the
    syncs that met rollouts cost otherwise: a design that meets them more often pays more per
    sync than predicted. One that waits for them simulates what they cost."""
    note = calibrate_module._pooled_syncs(*_syncs_meeting(0.9, 0.2), _FREEZES)
    assert note is not None
    assert "50% of the syncs met rollouts in flight and took 0.918 s" in note
    assert "the others 0.204 s" in note
    assert calibrate_module._pooled_syncs(*_syncs_meeting(0.5, 0.5), _FREEZES) is None
    waits = WeightSyncModel(fixed_s=0.5, mode="wait")  # simulates the wait: nothing hidden
    assert calibrate_module._pooled_syncs(*_syncs_meeting(0.9, 0.2), waits) is None


def test_seeded_bug_a_waiting_sync_noted_as_one_cost_for_both_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the note reads every kept sync as one that freezes the rollouts."""
    pooled = calibrate_module._pooled_syncs
    monkeypatch.setattr(
        calibrate_module,
        "_pooled_syncs",
        lambda walk, syncs, kept: pooled(walk, syncs, attrs.evolve(kept, mode="interrupt")),
    )
    with pytest.raises(AssertionError):
        test_syncs_that_cost_otherwise_with_rollouts_in_flight_are_noted()


def test_seeded_bug_syncs_that_cost_alike_noted_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate_module, "_differ", lambda a, b: True)
    with pytest.raises(AssertionError):
        test_syncs_that_cost_otherwise_with_rollouts_in_flight_are_noted()


def test_a_batching_engines_spread_is_read_within_rollouts_that_started_together() -> None:
    """Eight rollouts a step start together and end within 1%; from one step to the next their
    time varies fivefold (the machine's other work). The engine's spread is the first."""
    walk = calibrate_module._Walk(generations=4)
    for step in range(20):
        start, took = 10.0 * step, (0.1, 0.5, 0.2, 0.3)[step % 4]
        walk.intervals += [(0, start, start + took * (1 + 0.01 * (i % 2))) for i in range(8)]
        walk.rollouts += [(took, 8.0)] * 8
    assert calibrate_module._spread_within_starts(walk) == pytest.approx(0.005, abs=1e-3)
    generation, _ = calibrate_module._batching(walk, 4, 16)
    assert generation.sigma < 0.01
    assert generation.median_s == pytest.approx(0.275, rel=0.02)  # the mean time kept


def test_seeded_bug_batching_spread_across_steps_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spread read over every rollout, as if each drew its time alone."""

    def across(walk: Any) -> float:
        import statistics

        return statistics.pstdev([math.log(end - start) for _, start, end in walk.intervals])

    monkeypatch.setattr(calibrate_module, "_spread_within_starts", across)
    with pytest.raises(AssertionError):
        test_a_batching_engines_spread_is_read_within_rollouts_that_started_together()


_ONE_SIZE = [(16, 0.2 + 0.01 * (i % 5)) for i in range(99)] + [(32, 0.9)]
"""A pump's calls: all of one size but one, whose time happens to be long."""


def test_calls_of_one_size_cost_their_mean_whatever_their_rows() -> None:
    """A cost per row does not show in calls of one size: the slope is taken as flat (as a
    batching engine's is where its load never varied), not drawn through one odd call."""
    teacher = calibrate_module._teacher(_ONE_SIZE)
    assert teacher.per_row_s == 0.0
    assert teacher.fixed_s == pytest.approx(sum(s for _, s in _ONE_SIZE) / len(_ONE_SIZE))
    varied = calibrate_module._teacher([(r, 0.1 + 0.01 * r) for r in (4, 8, 16, 32) * 5])
    assert varied.fixed_s == pytest.approx(0.1) and varied.per_row_s == pytest.approx(0.01)


def test_seeded_bug_a_slope_through_one_odd_call_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibrate_module, "_varies", lambda sizes: len(set(sizes)) > 1)
    with pytest.raises(AssertionError):
        test_calls_of_one_size_cost_their_mean_whatever_their_rows()


def _probe_points(scale: float) -> list[tuple[int, float]]:
    """The served scenario's teacher (0.05 s a call, 0.01 s a row) on calls of 4 to 32 rows,
    `scale` times as fast as in its run (a probe runs with the engines otherwise idle)."""
    return [(r, scale * (0.05 + 0.01 * r)) for r in (4, 8, 16, 32) for _ in range(3)]


def test_a_probe_splits_the_cost_of_calls_of_one_size() -> None:
    """The probe's line gives the split (0.05 s a call to 0.01 s a row), the run's own calls
    the level: a call of the run's size costs their mean, as without the probe."""
    alone = calibrate_module._teacher(_ONE_SIZE)
    at_16 = statistics.fmean(s for r, s in _ONE_SIZE if r == 16)
    split = calibrate_module._with_probe(alone, 16, at_16, _probe_points(0.5))
    assert split.per_row_s / split.fixed_s == pytest.approx(0.2)
    assert split.fixed_s + 16 * split.per_row_s == pytest.approx(at_16)
    flat = [(r, 0.1) for r in (4, 8, 16, 32)]  # a probe that shows no cost per row
    assert calibrate_module._with_probe(alone, 16, at_16, flat) == alone


def test_a_probe_call_that_met_a_busy_server_does_not_tilt_the_split() -> None:
    """One call of 4 rows at ten times its time (as a served probe's first call can be): each
    size's median leaves it out."""
    alone = calibrate_module._teacher(_ONE_SIZE)
    probe = _probe_points(0.5)
    probe[0] = (4, 10 * probe[0][1])
    split = calibrate_module._with_probe(alone, 16, alone.fixed_s, probe)
    assert split.per_row_s / split.fixed_s == pytest.approx(0.2)


def test_seeded_bug_a_probe_line_through_every_call_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(statistics, "median", statistics.fmean)
    with pytest.raises(AssertionError):
        test_a_probe_call_that_met_a_busy_server_does_not_tilt_the_split()


@pytest.fixture(scope="module")
def inline_run(
    tmp_path_factory: pytest.TempPathFactory,
    served_scenario: str,
    served: Callable[..., tuple[Path, Any]],
) -> Path:
    """The served scenario run inline (every call one group of four rows), with a probe."""
    folder = tmp_path_factory.mktemp("inline")
    served(served_scenario, folder, variant=INLINE)
    calls = [ProbeCall("teacher", r, 10 * r, s) for r, s in _probe_points(0.6)]
    write_probe(folder / PROBE_FILE, calls)
    return folder


def test_an_inline_run_with_a_probe_predicts_the_pumps_calls(
    inline_run: Path, served_scenario: str
) -> None:
    """From calls of one group only, the pump's calls of several groups cost what they do in
    the pump's own run only where the probe tells the cost per row: without it, every call
    costs an inline call's mean."""
    truth = simulate(parse_scenario(served_scenario), PUMP_DEMAND, steps=60)
    per_call = truth.teacher_s_per_step / truth.calls_per_step
    fit = calibrate(inline_run)
    assert fit.scenario.teachers["teacher"].per_row_s > 0
    assert any("split one into" in note and PROBE_FILE in note for note in fit.notes)
    pump = simulate(fit.scenario, PUMP_DEMAND, steps=60)
    assert pump.teacher_s_per_step / pump.calls_per_step == pytest.approx(per_call, rel=0.15)
    (inline_run / PROBE_FILE).rename(inline_run / "away.json")
    try:
        blind = simulate(calibrate(inline_run).scenario, PUMP_DEMAND, steps=60)
    finally:
        (inline_run / "away.json").rename(inline_run / PROBE_FILE)
    assert blind.teacher_s_per_step / blind.calls_per_step < 0.7 * per_call


def test_seeded_bug_the_probe_left_unread_is_caught(
    inline_run: Path, served_scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate_module, "_with_probe", lambda teacher, *args: teacher)
    with pytest.raises(AssertionError):
        test_an_inline_run_with_a_probe_predicts_the_pumps_calls(inline_run, served_scenario)


def test_a_probe_that_is_not_one_is_refused_naming_it(
    tmp_path: Path, served_run: tuple[Path, Any]
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(served_run[0].parent, folder)
    (folder / PROBE_FILE).write_text("{")
    with pytest.raises(TraceCorrupt, match=f"{PROBE_FILE}: not a teacher probe"):
        calibrate(folder)


def _attributed(served_run: tuple[Path, Any], change: Callable[[Any], Any]) -> list[str]:
    """The attribution table of the served run against the simulation of its fit, changed by
    `change` (a scenario to a scenario), as its lines."""
    fit = calibrate(served_run[0])
    scenario = change(fit.scenario)
    result, simulated = simulated_terms(scenario, variant_of(scenario.pipeline))
    run = fit.observed.terms
    assert run.train_s + run.sync_s + run.waiting_s == pytest.approx(fit.observed.s_per_step)
    parts = simulated.train_s + simulated.sync_s + simulated.waiting_s
    assert parts == pytest.approx(result.s_per_step)
    return attribution_table(run, simulated).splitlines()


def _slower_sync(scenario: Any) -> Any:
    sync = scenario.weight_sync
    return attrs.evolve(scenario, weight_sync=attrs.evolve(sync, fixed_s=sync.fixed_s * 1.5))


def _slower_teacher(scenario: Any) -> Any:
    teachers = {
        name: attrs.evolve(t, fixed_s=t.fixed_s * 3, per_row_s=t.per_row_s * 3)
        for name, t in scenario.teachers.items()
    }
    return attrs.evolve(scenario, teachers=teachers)


def test_the_fit_of_a_served_run_errs_on_no_term(served_run: tuple[Path, Any]) -> None:
    """Each part of a step (train, weight sync, waiting for groups) adds up to its seconds on
    both sides, and the fit gets each within a few hundredths of a second."""
    lines = _attributed(served_run, lambda scenario: scenario)
    errors = [float(line.split()[-1].rstrip("s")) for line in lines[1:4]]
    assert max(map(abs, errors)) < 0.05, lines


@pytest.mark.parametrize(
    ("change", "term"),
    [(_slower_sync, "weight sync"), (_slower_teacher, "waiting for the step's groups")],
    ids=["sync", "teacher"],
)
def test_the_attribution_names_the_term_a_fit_gets_wrong(
    served_run: tuple[Path, Any], change: Callable[[Any], Any], term: str
) -> None:
    """Seeded wrong fits: a weight sync half again too long, teachers three times too slow.
    The attribution puts the largest error on the term that is wrong (a slow teacher shows
    as waiting for groups, with teacher seconds per call the cause)."""
    lines = _attributed(served_run, change)
    assert lines[-1].startswith(f"the error in seconds per step is {term} +"), lines
    if change is _slower_teacher:
        call = next(line for line in lines if "teacher seconds per call" in line)
        assert float(call.split()[-1].rstrip("%")) > 100, lines


def test_a_sync_that_finds_nothing_in_flight_is_fitted_apart(
    tmp_path: Path, served_scenario: str, served: Callable[[str, Path], tuple[Path, Any]]
) -> None:
    """A served engine resumes fast after a pause with nothing to drain: the fit reads the
    syncs that found no rollout in flight apart (`idle_s`), and each cost comes back."""
    text = served_scenario.replace('mode = "wait"', 'mode = "wait"\nidle_s = 0.06')
    trace, result = served(text, tmp_path)
    idle = sum("waited 0.000" in s.detail for s in result.spans if s.kind == "sync")
    assert idle >= calibrate_module._FEWEST_IDLE
    fit = calibrate(trace)
    sync = fit.scenario.weight_sync
    assert sync is not None and sync.mode == "wait"
    assert any("fitted apart (idle_s)" in note for note in fit.notes)
    assert sync.fixed_s == pytest.approx(0.6, rel=0.02)
    assert sync.idle_s == pytest.approx(0.06, rel=0.02)


def test_seeded_bug_idle_syncs_pooled_with_the_others_is_caught(
    tmp_path: Path,
    served_scenario: str,
    served: Callable[[str, Path], tuple[Path, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibrate_module, "_FEWEST_IDLE", 10**9)
    with pytest.raises(AssertionError):
        test_a_sync_that_finds_nothing_in_flight_is_fitted_apart(tmp_path, served_scenario, served)


def test_seeded_bug_syncs_fitted_apart_on_noise_is_caught(
    served_run: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served run's syncs cost the same with or without rollouts in flight: fitted apart
    anyway, the few idle ones' mean is noise, and the fit errs on the sync."""
    monkeypatch.setattr(calibrate_module, "_differ", lambda a, b: True)
    with pytest.raises(AssertionError):
        test_the_fit_of_a_served_run_errs_on_no_term(served_run)


@pytest.mark.parametrize("drain", [2.0, 4.0])
def test_rollouts_that_drain_slowly_are_fitted_back(
    served: Callable[[str, Path], tuple[Path, Any]],
    served_scenario: str,
    tmp_path: Path,
    drain: float,
) -> None:
    """A served run whose rollouts go `drain` times slower while a sync waits for them: the
    fit reads how much later after a sync's start they end than its simulation's do, and
    their own times without what the drain cost them."""
    _drain_fitted_back(served(_drained(served_scenario, drain), tmp_path), drain)


def _drained(scenario: str, drain: float) -> str:
    """The served run's scenario over 200 steps, its rollouts `drain` times slower while a
    sync waits for them."""
    text = scenario.replace("steps = 60", "steps = 200")
    return text.replace('mode = "wait"', f'mode = "wait"\ndrain = {drain}')


def _drain_fitted_back(run: tuple[Path, Any], drain: float) -> None:
    trace, truth = run
    fit = calibrate(trace)
    sync = fit.scenario.weight_sync
    assert sync is not None and sync.drain == pytest.approx(drain, rel=0.15)
    assert fit.scenario.generation.median_s == pytest.approx(0.3, rel=0.1)
    assert any("(drain)" in note for note in fit.notes)
    again = simulate(fit.scenario, variant_of(fit.scenario.pipeline))
    assert again.s_per_step == pytest.approx(truth.s_per_step, rel=0.05)


@pytest.fixture(scope="module")
def drained_run(
    tmp_path_factory: pytest.TempPathFactory,
    served_scenario: str,
    served: Callable[[str, Path], tuple[Path, Any]],
) -> Path:
    """The served run over 200 steps, its rollouts four times slower while a sync waits."""
    return served(_drained(served_scenario, 4.0), tmp_path_factory.mktemp("drained"))[0]


def _kept_errors(fit: Any) -> tuple[float, float, float, float]:
    """The errors the fit's note lists for the candidate it kept, as they are printed."""
    note = next(n for n in fit.notes if n.startswith("kept "))
    label = note.removeprefix("kept ").split(", of (")[0]
    for entry in note.split("): ", 1)[1].split("; "):
        name, *errors = entry.rsplit(" ", 4)
        if name == label:
            a, b, c, d = (float(e.removesuffix("%")) / 100 for e in errors)
            return a, b, c, d
    raise AssertionError(f"{label!r} is not among the candidates of {note!r}")


def test_the_kept_candidates_errors_are_those_of_the_scenario_it_returns(
    drained_run: Path,
) -> None:
    """A waiting candidate is compared with its drain fitted, so the errors the note prints
    for the kept one are the simulation of the scenario the fit returns."""
    fit = calibrate(drained_run)
    sync = fit.scenario.weight_sync
    assert sync is not None and sync.drain > 1
    steps = min(fit.scenario.steps, calibrate_module._CHOOSE_STEPS)
    again = simulate(fit.scenario, variant_of(fit.scenario.pipeline), steps=steps)
    s_per_step, _, calls, sync_s = _kept_errors(fit)
    assert again.s_per_step / fit.observed.s_per_step - 1 == pytest.approx(s_per_step, abs=6e-4)
    assert again.calls_per_step / fit.observed.calls_per_step - 1 == pytest.approx(calls, abs=6e-4)
    assert again.sync_s_per_step / fit.observed.sync_s_per_step - 1 == pytest.approx(
        sync_s, abs=6e-4
    )


def _undrained(candidates: Any) -> list[Any]:
    return [
        attrs.evolve(c, weight_sync=attrs.evolve(c.weight_sync, drain=1.0))
        if c.weight_sync is not None
        else c
        for c in candidates
    ]


@pytest.mark.parametrize("printed_only", [False, True], ids=["chosen", "printed"])
def test_seeded_bug_candidates_compared_before_their_drain_is_caught(
    printed_only: bool, drained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bugs: the fit chooses among the candidates as they were before their drains
    were fitted (and returns the chosen one drained): on this run it keeps a sync that
    freezes; or it chooses among the drained ones but prints the errors of the others."""
    choose = calibrate_module._choose

    def before_drain(candidates: Any, observed: Any, config: Any) -> Any:
        plain = _undrained(candidates)
        best, errors = choose(plain, observed, config)
        if printed_only:
            return choose(candidates, observed, config)[0], errors
        return candidates[plain.index(best)], errors

    monkeypatch.setattr(calibrate_module, "_choose", before_drain)
    with pytest.raises(AssertionError):
        test_the_kept_candidates_errors_are_those_of_the_scenario_it_returns(drained_run)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "apart"])
def test_rollouts_that_started_together_and_ended_together_are_read_in_lockstep(
    lockstep: bool,
    served: Callable[[str, Path], tuple[Path, Any]],
    served_scenario: str,
    tmp_path: Path,
) -> None:
    """A served run whose engine ends the rollouts it took at once together is read as one
    (the batching way of reading generation); one whose rollouts drew their times apart,
    spread as much together as apart, is not."""
    text = served_scenario + ("[engines]\nlockstep = true\n" if lockstep else "")
    trace, _ = served(text, tmp_path)
    _, bounds, walk = calibrate_module._walked(trace)
    _, engines = calibrate_module._batching(walk, bounds.shape.num_generations_per_prompt, 16)
    assert engines.lockstep is lockstep


@pytest.mark.parametrize(("share", "lockstep"), [(0.0, True), (math.inf, False)])
def test_seeded_bug_lockstep_read_never_or_always_is_caught(
    share: float,
    lockstep: bool,
    served: Callable[[str, Path], tuple[Path, Any]],
    served_scenario: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibrate_module, "_LOCKSTEP", share)
    with pytest.raises(AssertionError):
        test_rollouts_that_started_together_and_ended_together_are_read_in_lockstep(
            lockstep, served, served_scenario, tmp_path
        )


def test_rollouts_that_drain_as_fast_as_simulated_are_left_alone(
    outlasted_by_noise: Path,
) -> None:
    sync = calibrate(outlasted_by_noise).scenario.weight_sync
    assert sync is not None and sync.mode == "wait" and sync.drain == 1.0


def test_seeded_bug_a_drain_fitted_to_noise_is_caught(
    outlasted_by_noise: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate_module, "_differ", lambda a, b: True)
    with pytest.raises(AssertionError):
        test_rollouts_that_drain_as_fast_as_simulated_are_left_alone(outlasted_by_noise)


def test_seeded_bug_the_drains_cost_left_in_the_rollouts_is_caught(
    served: Callable[[str, Path], tuple[Path, Any]],
    served_scenario: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rollouts' times kept as they were: the simulation slows them a second time."""
    real = calibrate_module._unfrozen

    def kept(walk: Any, syncs: Any, lost: float = 1.0) -> Any:
        return walk if lost < 1 else real(walk, syncs, lost)

    run = served(_drained(served_scenario, 2.0), tmp_path)
    monkeypatch.setattr(calibrate_module, "_unfrozen", kept)
    with pytest.raises(AssertionError):
        _drain_fitted_back(run, 2.0)
