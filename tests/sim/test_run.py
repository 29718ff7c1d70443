"""The simulator: deterministic, and the comparisons that are certain (never tuned figures).

Seeded bugs, each caught by the test named after it: trio's scheduler seeded but left in its
own mode, where tasks woken at one virtual instant run in the order of their memory addresses;
a learner that blocks the loop before the tasks ready at its step's start have run.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from groupflow.cli import main
from groupflow.impl.contract import TrainBatch
from groupflow.impl.testing import FakeLearner
from groupflow.sim import run as run_module
from groupflow.sim.run import INLINE, PUMP_DEMAND, PUMP_TIMER, Variant, simulate, trace_hash
from groupflow.sim.scenario import load_scenario, parse_scenario, shipped_scenarios
from tests.helpers import ROOT, SLOW_TEACHER_SCENARIO

SIMULTANEOUS = """
name = "simultaneous"
steps = 6
[pipeline]
prompts_per_step = 8
num_generations_per_prompt = 4
max_inflight_prompts = 8
max_buffered_groups = 16
gate_window = 0
[scoring]
max_batch_groups = 3
flush_after_s = 30.0
[generation]
median_s = 5.0
[teachers.teacher]
dp = 4
fixed_s = 1.0
[train]
step_s = 2.0
"""


def test_shipped_scenarios_are_there() -> None:
    assert {
        "shipped-recipe",
        "shipped-recipe-wide",
        "compute-bound-teacher",
        "two-teachers",
        "faults",
        "fast-generation",
    } <= set(shipped_scenarios())


@pytest.mark.parametrize("name", shipped_scenarios())
def test_same_scenario_and_seed_same_trace(name: str) -> None:
    scenario = load_scenario(name)
    first = simulate(scenario, PUMP_DEMAND, steps=6, seed=3)
    second = simulate(scenario, PUMP_DEMAND, steps=6, seed=3)
    assert first.trace_hash == second.trace_hash
    assert first.virtual_s == second.virtual_s
    other_seed = simulate(scenario, PUMP_DEMAND, steps=6, seed=4)
    assert other_seed.trace_hash != first.trace_hash


TIES = """
name = "ties"
steps = 10
[pipeline]
prompts_per_step = 8
num_generations_per_prompt = 4
max_inflight_prompts = 16
max_buffered_groups = 32
[scoring]
max_batch_groups = 8
flush_after_s = 0.05
[generation]
median_s = 0.004
sigma = 1.0
min_s = 0.004
[teachers.teacher]
fixed_s = 0.05
per_row_s = 0.01
[weight_sync]
fixed_s = 0.7
spread = [0.1, 1.9]
mode = "interrupt"
[train]
step_s = 0.02
blocks_loop = true
[engines]
batching = false
"""
"""Rollouts at their floor time on an engine that serves one at a time, behind a learner that
blocks the loop: many tasks wake at one virtual instant (a fitted served run's shape)."""


@pytest.mark.parametrize("variant", [INLINE, PUMP_DEMAND], ids=["inline", "pump"])
def test_tasks_woken_at_one_instant_run_in_the_same_order_every_time(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the test runner (Hypothesis makes trio's scheduler deterministic for every
    test), `groupflow sim` gives the same trace for one scenario and seed every time."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    scenario = parse_scenario(TIES)
    hashes = {simulate(scenario, variant).trace_hash for _ in range(4)}
    assert len(hashes) == 1, hashes
    assert trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING is False  # left as it was


def test_a_learner_that_blocks_the_loop_lets_the_ready_tasks_run_first() -> None:
    """The tasks ready when a blocking step starts (and those they wake) run at its start;
    a task that sleeps meanwhile wakes only after the step, whatever its deadline."""
    seen: list[tuple[str, float]] = []

    async def other() -> None:
        seen.append(("ready", trio.current_time()))
        await trio.lowlevel.checkpoint()
        seen.append(("woken", trio.current_time()))
        await trio.sleep(0.1)
        seen.append(("slept", trio.current_time()))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await FakeLearner(latency=1.0, blocking=True).train_step(TrainBatch(0, 0, (), {}))
            seen.append(("trained", trio.current_time()))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert seen[:2] == [("ready", 0.0), ("woken", 0.0)]
    assert sorted(seen[2:]) == [("slept", 1.0), ("trained", 1.0)]  # in either order


def test_seeded_bug_a_blocking_learner_that_blocks_at_once_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the learner jumps the clock before the ready tasks run."""

    async def at_once(cushion: float = 0.0) -> None:
        return None

    monkeypatch.setattr(trio.testing, "wait_all_tasks_blocked", at_once)
    with pytest.raises(AssertionError):
        test_a_learner_that_blocks_the_loop_lets_the_ready_tasks_run_first()


def test_seeded_bug_the_scheduler_seeded_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def seeded_alone(seed: int) -> Iterator[None]:
        trio._core._run._r.seed(seed)
        yield

    monkeypatch.setattr(run_module, "_scheduled_by", seeded_alone)
    with pytest.raises(AssertionError):
        test_tasks_woken_at_one_instant_run_in_the_same_order_every_time(INLINE, monkeypatch)


@pytest.mark.parametrize("name", ["shipped-recipe", "compute-bound-teacher", "two-teachers"])
def test_inline_calls_once_per_group_and_pump_never_more(name: str) -> None:
    scenario = load_scenario(name)
    inline = simulate(scenario, INLINE, steps=8, seed=1)
    groups = 8 * scenario.pipeline.shape.prompts_per_step
    assert inline.teacher_calls == groups and inline.rows_per_call == 4
    assert inline.permit_seconds_scoring > 0
    for pump in (PUMP_TIMER, PUMP_DEMAND):
        result = simulate(scenario, pump, steps=8, seed=1)
        assert result.teacher_calls <= inline.teacher_calls
        assert result.permit_seconds_scoring == 0.0
        assert result.outcome == "ok" and result.steps == 8


def test_groups_finishing_together_go_in_ceil_p_over_b_calls_per_step() -> None:
    scenario = parse_scenario(SIMULTANEOUS)
    result = simulate(scenario, PUMP_DEMAND, seed=0)
    per_step = math.ceil(8 / 3)
    assert result.teacher_calls == scenario.steps * per_step


def test_batching_gains_less_on_a_compute_bound_teacher() -> None:
    def saving(name: str) -> float:
        scenario = load_scenario(name)
        inline = simulate(scenario, INLINE, steps=8, seed=2)
        pump = simulate(scenario, PUMP_DEMAND, steps=8, seed=2)
        return pump.teacher_busy_s / inline.teacher_busy_s

    assert saving("compute-bound-teacher") > saving("shipped-recipe")


def test_faults_scenario_crashes_resumes_and_finishes() -> None:
    scenario = load_scenario("faults")
    result = simulate(scenario, PUMP_DEMAND, seed=0)
    assert result.outcome == "ok" and result.crashed and result.resumed_from_checkpoint
    assert result.steps == scenario.steps
    assert any(not s.ok for s in result.spans if s.kind == "score")


def test_scheduled_teacher_errors_are_retried_alone() -> None:
    text = SIMULTANEOUS.replace("[train]", "[faults]\nscorer_error_calls = [0]\n[train]")
    result = simulate(parse_scenario(text), PUMP_DEMAND, seed=0)
    failed = [s for s in result.spans if s.kind == "score" and not s.ok]
    assert len(failed) == 1 and failed[0].detail == "3 groups"
    retried = [s for s in result.spans if s.kind == "score" and s.detail == "1 groups"]
    assert len(retried) >= 3, "each group of the failed call is retried alone"
    assert result.outcome == "ok" and result.discarded == 0


def test_hung_teacher_is_caught_by_the_watchdog() -> None:
    text = SIMULTANEOUS.replace("[train]", "[faults]\nscorer_hang_call = 1\n[train]").replace(
        "gate_window = 0", "gate_window = 0\nstall_timeout_s = 60.0\nstall_action = 'abort'"
    )
    result = simulate(parse_scenario(text), PUMP_DEMAND, seed=0)
    assert result.outcome.startswith("failed: monitor 'stall watchdog'")


def test_scenario_errors_name_the_file_and_the_value() -> None:
    with pytest.raises(
        ValueError, match=r"bad\.toml: .*max_buffered_groups=7 is smaller than prompts_per_step=8"
    ):
        parse_scenario(
            SIMULTANEOUS.replace("max_buffered_groups = 16", "max_buffered_groups = 7"),
            source="bad.toml",
        )
    with pytest.raises(ValueError, match="no scenario 'nope'"):
        load_scenario("nope")
    stray = SIMULTANEOUS.replace("[pipeline]\n", "[pipeline]\ncheckpoint_every_steps = 2\n", 1)
    assert stray != SIMULTANEOUS
    with pytest.raises(
        ValueError, match=r"\[pipeline\] has unknown keys \['checkpoint_every_steps'\]; known: "
    ):
        parse_scenario(stray, source="stray.toml")


def test_cli_compares_designs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "timeline.png"
    assert main(["sim", "--scenario", "fast-generation", "--steps", "4", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "pump (demand) / inline: s_per_step x" in out and "inline" in out
    assert plot.stat().st_size > 10_000
    assert main(["sim", "--design", "all", "--steps", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["design"] for r in rows] == ["inline", "pump (timer)", "pump (demand)", "bound"]
    assert all(r["steps"] == 3 and len(r["trace_hash"]) == 16 for r in rows)


def _seeds_problems(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Where `groupflow sim --seeds 3` does not show, for each design, the mean of each figure
    over seeds 0 to 2 and beneath it their range, as three simulations of their own give."""
    argv = ["sim", "--scenario", "fast-generation", "--steps", "4", "--seeds", "3"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    problems = []
    if "inline: 3 seeds, 12 steps simulated in" not in err:
        problems.append(f"the simulator's speed does not count the seeds: {err}")
    for variant in (INLINE, PUMP_DEMAND):
        alone = [
            simulate(load_scenario("fast-generation"), variant, steps=4, seed=s) for s in range(3)
        ]
        times = [r.s_per_step for r in alone]
        at = next(i for i, line in enumerate(lines) if line.startswith(variant.label + " "))
        mean, span = lines[at].split()[len(variant.label.split())], lines[at + 1].split()[1]
        if mean != f"{sum(times) / 3:.2f}":
            problems.append(f"{variant.label}: mean {mean}, seeds alone {times}")
        if span != f"{min(times):.2f}-{max(times):.2f}":
            problems.append(f"{variant.label}: range {span}, seeds alone {times}")
    if "seeds 0 to 2" not in lines[0]:
        problems.append(f"the heading does not name the seeds: {lines[0]}")
    return problems


def test_seeds_show_each_figures_mean_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert _seeds_problems(capsys) == []


def test_seeded_bug_one_seed_simulated_again_is_caught(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A seeded bug: every simulation of `--seeds` runs the first seed."""
    from groupflow.cli import _sim

    monkeypatch.setattr(_sim, "_seeds", lambda args: [args.seed] * args.seeds)
    assert _seeds_problems(capsys)


@pytest.mark.parametrize("flag", ["--plot", "--trace"])
def test_seeds_refuse_what_shows_one_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / ("timeline.png" if flag == "--plot" else "trace.jsonl")
    assert main(["sim", "--design", "pump", "--seeds", "2", flag, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} shows one run" in err[0] and "--seeds 2" in err[0]
    assert not out.exists()


def test_trace_hash_ignores_the_order_of_simultaneous_spans() -> None:
    result = simulate(load_scenario("faults"), PUMP_TIMER, steps=6, seed=0)
    assert trace_hash(list(reversed(result.spans))) == result.trace_hash
    again = simulate(load_scenario("faults"), PUMP_TIMER, steps=6, seed=0)
    assert again.trace_hash == result.trace_hash


@pytest.mark.parametrize("variant", [INLINE, PUMP_DEMAND])
def test_scoring_figures_count_the_crashed_run_too(variant: Variant) -> None:
    result = simulate(load_scenario("faults"), variant, seed=0)
    in_calls = sum(int(s.detail.split()[0]) for s in result.spans if s.kind == "score")
    assert result.groups_scored == in_calls


def test_scheduled_errors_hit_one_call_even_with_two_teachers() -> None:
    text = load_scenario_text("two-teachers").replace(
        "[train]", "[faults]\nscorer_error_calls = [0, 5]\n[train]"
    )
    result = simulate(parse_scenario(text), INLINE, steps=4, seed=0)
    assert sum(1 for s in result.spans if s.kind == "score" and not s.ok) == 2


def test_crash_before_any_checkpoint_restarts_from_scratch() -> None:
    text = SIMULTANEOUS.replace("[train]", "[faults]\ncrash_at_s = 9.0\n[train]")
    result = simulate(parse_scenario(text), PUMP_DEMAND, seed=0)
    assert result.crashed and not result.resumed_from_checkpoint
    assert result.outcome == "ok" and result.steps == 6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("steps = 6", "steps = 0"), "steps must be an int >= 1"),
        (("steps = 6", "step = 6"), "unknown keys"),
        (("median_s = 5.0", "median_s = 0"), "median_s must be > 0"),
        (("median_s = 5.0", "median_s = 5.0\ntoken_share = 0.5"), "token_share = 0.5 need tokens"),
        (("median_s = 5.0", "median_s = 5.0\ntokens = 9\ntoken_share = 2"), "at most 1"),
        (("median_s = 5.0", "median_s = 5.0\ntokens = -1"), "tokens must be"),
        (("median_s = 5.0", "median_s = 5.0\ntokens = 0.3"), "0 or >= 1, got 0.3"),
        (("median_s = 5.0", "median_s = 5.0\ntoken_sigma = 1"), r"\[generation\] has unknown"),
        (
            ("dp = 4", "dp = 4\nper_token_s = 1e-4"),
            r"per_token_s = 0.0001 needs \[generation\] tokens",
        ),
        (("dp = 4", "dp = 0"), "dp must be a positive int"),
        (("step_s = 2.0", "step_s = -1"), "step_s must be seconds >= 0"),
        (("[train]", "[faults]\nrollout_failure_rate = 1.5\n[train]"), "at most 1"),
        (("[train]", "[faults]\nscorer_error_calls = '12'\n[train]"), "list of numbers"),
        (("[train]", "[faults]\nscorer_hang_call = 1\n[train]"), "stall_action = 'abort'"),
        (("[train]", "[faluts]\ncrash_at_s = 5.0\n[train]"), "unknown keys"),
    ],
)
def test_bad_scenarios_are_refused(change: tuple[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_scenario(SIMULTANEOUS.replace(*change), source="s.toml")


@pytest.mark.parametrize("flag", ["--steps", "--seeds"])
def test_cli_refuses_zero_steps_or_seeds(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", flag, "0"])
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def load_scenario_text(name: str) -> str:
    return (ROOT / "sim" / "scenarios" / f"{name}.toml").read_text()


def _no_step_as_json() -> str:
    from groupflow.sim.report import as_json

    result = simulate(parse_scenario(SLOW_TEACHER_SCENARIO), PUMP_DEMAND)
    assert result.steps == 0 and result.outcome != "ok"
    return json.dumps(as_json([result]), allow_nan=False)


def test_a_run_that_trains_no_step_is_json_with_its_figures_null() -> None:
    (got,) = json.loads(_no_step_as_json())
    assert got["steps"] == 0 and got["s_per_step"] is None and got["calls_per_step"] is None
    assert got["outcome"].startswith("failed")


def test_seeded_bug_a_nan_in_the_json_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded bug: a figure per step of a run with no step is written as NaN."""
    from groupflow.sim import report

    monkeypatch.setattr(report, "json_number", lambda value: round(value, 6))
    with pytest.raises(ValueError, match="not JSON compliant"):
        _no_step_as_json()


_GIVEN_UP_SCENARIO = (
    SLOW_TEACHER_SCENARIO.replace("fixed_s = 1e12", "fixed_s = 0.5").replace(
        "steps = 2", "steps = 3"
    )
    + "[faults]\nrollout_failure_rate = 0.6\n"
)
"""Rollouts that fail more often than not: with seed 1, one step of three has every prompt given
up, and two steps train."""


def test_a_skipped_step_is_counted_and_said() -> None:
    from groupflow.sim.report import as_json, table

    result = simulate(parse_scenario(_GIVEN_UP_SCENARIO), INLINE, seed=1)
    assert result.outcome == "ok" and result.steps == 3
    assert result.skipped_steps == 1
    assert "1 of 3 steps skipped" in table([result])
    assert as_json([result])[0]["skipped_steps"] == 1


def test_seeded_bug_a_skipped_step_left_uncounted_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug: the simulation counts no skipped step, and its table says nothing."""
    monkeypatch.setattr(run_module, "_skipped", lambda pipelines: 0)
    with pytest.raises(AssertionError):
        test_a_skipped_step_is_counted_and_said()
