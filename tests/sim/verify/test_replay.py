"""`groupflow replay`: traces of real pipeline runs (crash and resume included, under both
checkpoint policies) replay as valid; hand-corrupted ones are rejected at the line that broke;
a run that did not end or failed is reported as such; and the replay's own checks are shown to
matter by seeding bugs into it, each of which a case below must catch."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.cli import main
from groupflow.impl._pipeline import load_checkpoint
from groupflow.impl.errors import TraceCorrupt, TraceNotFound
from groupflow.model.scheduler import transition
from groupflow.sim.run import PUMP_DEMAND, simulate
from groupflow.sim.scenario import load_scenario
from groupflow.sim.verify import replay as replay_module
from groupflow.sim.verify.conformance import Conformance, bounds_for, model_step
from groupflow.sim.verify.replay import (
    FAILED,
    INCOMPLETE,
    REJECTED,
    VALID,
    Incarnation,
    ReplayResult,
    replay,
)
from tests.traced import PROMPTS, TracedRun, build, config, read, traced_run, write

Lines = list[dict[str, Any]]


def _index(lines: Lines, test: Callable[[dict[str, Any]], bool], nth: int = 0) -> int:
    return [i for i, line in enumerate(lines) if test(line)][nth]


# -- real runs replay as valid ------------------------------------------------------------------


async def test_a_clean_run_replays_as_valid(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await traced_run(tmp_path)
    result = replay(tmp_path)  # the run folder holds trace.jsonl
    assert result.ok, result.verdict_line()
    assert result.actions == len(run.checker.trace) and len(result.incarnations) == 1
    assert result.trained == frozenset(range(PROMPTS)) and not result.given_up
    assert main(["replay", str(run.trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("VALID: ") and "every prompt was trained once" in out[0]
    assert f"1 incarnation, 0 crashes; {PROMPTS} prompts: {PROMPTS} trained" in out[1]


@pytest.mark.parametrize("policy", ["flush", "uncommitted"])
@pytest.mark.parametrize("crash_at", [3.0, 12.0, 15.0, 20.0])
async def test_a_crash_and_resume_replay_as_valid(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, policy: str, crash_at: float
) -> None:
    run = await traced_run(tmp_path, policy=policy, crash_at=crash_at)
    assert run.crashed and run.checker.ok, run.checker.failure
    result = replay(run.trace)
    assert result.ok, result.verdict_line()
    first, second = result.incarnations
    assert first.outcome is None and second.outcome == "ok"
    assert (second.resumed_from is not None) == run.resumed
    assert result.trained | result.given_up == frozenset(range(PROMPTS))
    assert "1 crash" in result.summary()


async def test_uncommitted_resumes_reissue_prompts_and_replay_as_valid(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The `uncommitted` policy saves with groups in flight: the resume issues them again,
    and the replay's resume check compares that re-issue list with the model's."""
    run = await traced_run(tmp_path, policy="uncommitted", crash_at=15.0)
    resume = next(line for line in read(run.trace) if line["type"] == "resume")
    assert resume["ledger"]["reissue"] or resume["ledger"]["saved"]
    assert replay(run.trace).ok


def test_a_simulated_crash_with_faults_replays_as_valid(tmp_path: Path) -> None:
    result = simulate(load_scenario("faults"), PUMP_DEMAND, trace=tmp_path / "t.jsonl")
    assert result.crashed and result.resumed_from_checkpoint
    replayed = replay(tmp_path / "t.jsonl")
    assert replayed.ok, replayed.verdict_line()
    assert replayed.given_up and len(replayed.incarnations) == 2


async def test_a_failed_run_is_reported_failed_with_what_is_open(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await traced_run(tmp_path, fail_steps=frozenset({1}))
    assert run.failed
    result = replay(run.trace)
    assert result.verdict == FAILED and "the run failed (PumpFailed" in str(result.problem)
    assert result.open == tuple(range(4, PROMPTS))
    assert main(["replay", str(run.trace)]) == 1
    assert capsys.readouterr().out.startswith("FAILED: the run failed")


async def test_a_crashed_run_not_resumed_is_incomplete(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, crash_at=15.0, resume=False)
    result = replay(run.trace)
    assert result.verdict == INCOMPLETE and "has no end line" in str(result.problem)
    assert result.open and len(result.trained) < PROMPTS
    assert "open (" in result.summary()


async def test_the_truncated_last_line_of_a_crash_is_reported_and_the_rest_checked(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await traced_run(tmp_path, crash_at=15.0, resume=False)
    whole = replay(run.trace)
    with run.trace.open("a") as f:
        f.write('{"type":"action","incarnation":0,"kind":"comm')
    result = replay(run.trace)
    assert result.verdict == INCOMPLETE
    assert f"its last line ({whole.lines + 1}) is cut short" in str(result.problem)
    assert result.actions == whole.actions  # everything before it was checked
    n = whole.lines + 1
    assert (
        f"line {n}, the last, is cut short (the process died writing it); the {n - 1} lines "
        f"before it are checked"
    ) in result.notes
    assert main(["replay", str(run.trace)]) == 1
    assert "cut short" in capsys.readouterr().out


async def test_a_line_torn_by_a_crash_then_a_restart_is_a_note(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, crash_at=15.0)
    text = run.trace.read_text().splitlines(keepends=True)
    second = _index(read(run.trace), lambda line: line["type"] == "header", 1)
    torn = '{"type":"action","incarnation":0,"kind":"sco\n'
    run.trace.write_text("".join(text[:second] + [torn] + text[second:]))
    result = replay(run.trace)
    assert result.ok, result.verdict_line()
    assert any(f"line {second + 1} was cut short by the crash" in n for n in result.notes)


async def test_a_line_cut_short_in_the_middle_of_a_trace_is_rejected_naming_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A torn line is a crash's mark only when a restart's header follows it; an action after
    it means the trace itself is damaged. A blank line is skipped."""
    run = await traced_run(tmp_path)
    text = run.trace.read_text().splitlines(keepends=True)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("".join(text[:3] + ["\n"] + text[3:]))
    assert replay(blank).ok, replay(blank).verdict_line()
    torn = tmp_path / "torn.jsonl"
    cut = '{"type":"action","incarnation":0,"kind":"commit","ordinal":3,"group":"p3-3","from"'
    torn.write_text("".join([*text[:3], cut + "\n", *text[3:]]))
    result = replay(torn)
    assert result.verdict == REJECTED and result.line == 4, result.verdict_line()
    assert result.problem == f"line 4 is not a JSON object with a type: {cut[:80]!r}"
    assert len(cut) > 80
    # before a restart's resume line, not its header: damaged too
    crashed = await _trace(tmp_path, crash_at=20.0)
    text = [json.dumps(line) + "\n" for line in crashed]
    resume = _resume_line(crashed)
    torn.write_text("".join(text[:resume] + ['{"type":"action","inc\n'] + text[resume:]))
    result = replay(torn)
    assert result.verdict == REJECTED and result.line == resume + 1, result.verdict_line()


async def test_the_end_of_run_accounting_catches_a_lost_prompt_the_line_checks_missed(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prompt trained once or given up is checked again at the end of the trace: with
    the per-line agreement switched off, a trained prompt dropped from its line still shows,
    at the end line."""
    run = await traced_run(tmp_path)
    lines = read(run.trace)
    i = _index(lines, lambda line: line.get("kind") == "trained", 1)
    dropped = lines[i]["trained"].pop()
    monkeypatch.setattr(replay_module._Replay, "agree", lambda self, *args: None)
    lines[-1]["trained"] -= 1  # the end line counts what the trace says
    result = replay(write(tmp_path / "lost.jsonl", lines))
    assert result.verdict == REJECTED and result.line == len(lines), result.verdict_line()
    assert f"prompts [{dropped}] were neither trained nor given up: lost" in str(result.problem)


async def test_a_run_cancelled_from_outside_replays_as_a_crash(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """An enclosing cancel scope ends the run while it runs (no `trace.crash()` first): the
    trace says so in a crash line; alone it is incomplete, and with a restart from the newest
    checkpoint it is valid."""
    cfg = config()
    run = TracedRun(tmp_path / "trace.jsonl", Conformance(bounds_for(cfg, prompts=PROMPTS)))
    with trio.fail_after(10_000):
        with trio.move_on_after(15.0):
            await build(tmp_path, run, cfg).run()
        alone = replay(run.trace)
        assert alone.verdict == INCOMPLETE and "cancelled from outside (line" in str(alone.problem)
        pipeline = build(tmp_path, run, cfg)
        await pipeline.resume_from(load_checkpoint(tmp_path / "run-0"))
        await pipeline.run()
    result = replay(run.trace)
    assert result.ok, result.verdict_line()
    assert result.incarnations[1].resumed_from is not None
    assert any("was cancelled from outside while running" in note for note in result.notes)


# -- hand-corrupted traces are rejected at the line that broke ---------------------------------


def _first_commit(lines: Lines) -> int:
    return _index(lines, lambda line: line.get("kind") == "commit")


def _restart_header(lines: Lines) -> int:
    return _index(lines, lambda line: line["type"] == "header", 1)


def _first_trained(lines: Lines) -> int:
    return _index(lines, lambda line: line.get("kind") == "trained")


def _end_line(lines: Lines) -> int:
    return len(lines) - 1


def _set(find: Callable[[Lines], int], field: str, value: Any) -> Callable[[Lines], int]:
    """A corruption that sets one field of the line `find` picks, and names that line."""

    def corrupt(lines: Lines) -> int:
        i = find(lines)
        lines[i][field] = value
        return i

    return corrupt


def _resume_line(lines: Lines) -> int:
    return _index(lines, lambda line: line["type"] == "resume")


def _first_after_the_resume(lines: Lines) -> int:
    return _resume_line(lines) + 1


def _given_up(ordinal: int) -> Callable[[Lines], int]:
    return lambda lines: _index(lines, lambda line: line.get("given_up") == [ordinal])


def _action_of(kind: str, ordinal: int) -> Callable[[Lines], int]:
    return lambda lines: _index(
        lines, lambda line: line.get("kind") == kind and line["ordinal"] == ordinal
    )


def _given_up_twice(lines: Lines) -> int:
    """The second prompt given up after the restart is given as the first one again (prompts
    that finish at the same virtual time may be traced in either order)."""
    restart = _restart_header(lines)
    first, second = [i for i in range(restart, len(lines)) if lines[i].get("given_up")][:2]
    lines[second]["given_up"] = lines[first]["given_up"]
    return second


def _drop(find: Callable[[Lines], int], field: str) -> Callable[[Lines], int]:
    """A corruption that drops one field of the line `find` picks, and names that line."""

    def corrupt(lines: Lines) -> int:
        i = find(lines)
        del lines[i][field]
        return i

    return corrupt


def _bare_header_before_the_restart(lines: Lines) -> int:
    """A bare header (incarnation 1) before the restart's, which still says incarnation 1."""
    i = _restart_header(lines)
    lines.insert(i, dict(lines[i]))
    return i + 1


def _given_up_after_it_was_trained(lines: Lines) -> int:
    i = _index(lines, lambda line: line.get("kind") == "trained", 1)
    lines[i]["given_up"] = [0]
    return i


def _trained_not_by_the_model(lines: Lines) -> int:
    i = _first_trained(lines)
    lines[i]["trained"] = [*lines[i]["trained"], PROMPTS - 1]
    return i


def _overcounted_end(lines: Lines) -> int:
    lines[-1]["trained"] += 1
    return len(lines) - 1


def _forbidden_action(lines: Lines) -> int:
    """A commit of a prompt that was never admitted."""
    i = _first_commit(lines)
    lines[i]["ordinal"] = PROMPTS - 1
    return i


def _trained_twice(lines: Lines) -> int:
    i = _index(lines, lambda line: line.get("kind") == "trained", 1)
    lines[i]["trained"] = [*lines[i]["trained"], 0]
    return i


def _lost_ordinal(lines: Lines) -> int:
    i = _index(lines, lambda line: line.get("kind") == "trained", 1)
    lines[i]["trained"] = lines[i]["trained"][:-1]
    return i


def _miscounted_end(lines: Lines) -> int:
    lines[-1]["trained"] -= 1
    return len(lines) - 1


def _after_the_end(lines: Lines) -> int:
    lines.append(dict(lines[-2]))
    return len(lines) - 1


def _dropped_line(lines: Lines) -> int:
    """A line lost from the middle: the admit of prompt 5; the model then refuses the next
    admit (prompt 6 before 5)."""
    i = _index(lines, lambda line: line.get("kind") == "admit" and line["ordinal"] == 5)
    del lines[i]
    return _index(lines, lambda line: line.get("kind") == "admit" and line["ordinal"] == 6)


def _untouched(lines: Lines) -> int:
    return len(lines) - 1


def _stale_resume(lines: Lines) -> int:
    i = _index(lines, lambda line: line["type"] == "resume")
    lines[i]["step"] -= 1
    return i


def _fresh_start_after_a_checkpoint(lines: Lines) -> int:
    i = _index(lines, lambda line: line["type"] == "resume")
    del lines[i]
    return i


def _action_after_a_crash_line(lines: Lines) -> int:
    i = _first_commit(lines)
    lines.insert(i, {"type": "crash", "incarnation": 0, "reason": "cancelled from outside"})
    return i + 1


def _first_header_not_zero(lines: Lines) -> int:
    lines[0]["incarnation"] = 1
    return 0


def _resume_twice(lines: Lines) -> int:
    i = _index(lines, lambda line: line["type"] == "resume")
    lines.insert(i + 1, dict(lines[i]))
    return i + 1


def _resume_without_a_step(lines: Lines) -> int:
    i = _index(lines, lambda line: line["type"] == "resume")
    del lines[i]["step"]
    return i


def _resume_ledger_without_a_cursor(lines: Lines) -> int:
    i = _index(lines, lambda line: line["type"] == "resume")
    del lines[i]["ledger"]["cursor"]
    return i


def _resume_with_nothing_saved(lines: Lines) -> int:
    """A resume line after a crash that came before the first save."""
    i = _restart_header(lines)
    empty = {"cursor": 0, "trained": [], "shortfall": [], "saved": [], "reissue": []}
    lines.insert(i + 1, {"type": "resume", "incarnation": 1, "step": 0, "ledger": empty})
    return i + 1


def _given_up_as_it_is_trained(lines: Lines) -> int:
    i = _first_trained(lines)
    lines[i]["given_up"] = [lines[i]["trained"][0]]
    return i


def _end_before_the_exit(lines: Lines) -> int:
    i = _first_trained(lines)
    lines.insert(i, dict(lines[-1]))
    return i


@attrs.frozen
class Case:
    corrupt: Callable[[Lines], int]
    """Corrupts the lines in place; returns the index of the line that must be named."""
    says: str
    run: dict[str, Any] = attrs.field(factory=dict)
    """How the run is made: `traced_run`'s arguments, or `scenario` for the simulator's."""
    verdict: str = REJECTED
    ends: bool = False
    """The problem must end with `says` (nothing more listed after it)."""
    before: str = VALID
    """The verdict on the untouched trace."""


FAULTS = {"scenario": "faults"}
"""The simulator's run with failures: prompts given up, a crash and a resume."""

CASES = {
    "untouched": Case(_untouched, "", verdict=VALID),
    "forbidden-action": Case(_forbidden_action, "the model does not allow rollout of prompt 15"),
    "trained-twice": Case(_trained_twice, "prompt 0 trained a second time (first at line"),
    "lost-ordinal": Case(
        _lost_ordinal,
        "the trace says it trained prompts [4, 5, 6], the model trained [4, 5, 6, 7] (prompts "
        "[7] trained but lost from the trace)",
        ends=True,
    ),
    "trained-not-by-the-model": Case(
        _trained_not_by_the_model,
        f"the trace says it trained prompts [0, 1, 2, 3, {PROMPTS - 1}], the model trained "
        f"[0, 1, 2, 3]",
        ends=True,
    ),
    "wrong-state": Case(
        _set(_action_of("commit", 0), "to", "READY"),
        "the trace moves the group to READY, the model to WRITTEN",
    ),
    "wrong-state-of-an-admit": Case(
        _set(_action_of("admit", 4), "to", "SCORING"),
        "the trace moves the group to SCORING, the model to RESERVED",
    ),
    "miscounted-end": Case(
        _miscounted_end,
        f"the end line counts {PROMPTS - 1} prompts trained and 0 given up, the trace "
        f"{PROMPTS} and 0",
        ends=True,
    ),
    "overcounted-end": Case(
        _overcounted_end,
        f"the end line counts {PROMPTS + 1} prompts trained and 0 given up, the trace "
        f"{PROMPTS} and 0",
        ends=True,
    ),
    "line-after-the-end": Case(_after_the_end, "after incarnation 0's end line"),
    "dropped-line": Case(_dropped_line, "the model does not allow admit prompt 6"),
    "ok-after-failure": Case(
        _set(_end_line, "outcome", "ok"),
        "ended ok, but it failed or stopped early in the model",
        {"fail_steps": frozenset({1})},
        before=FAILED,
    ),
    "ok-after-a-stop": Case(
        _set(_end_line, "outcome", "ok"),
        "ended ok, but it failed or stopped early in the model",
        {"stop_at": 10.0},
        before=INCOMPLETE,
    ),
    "stale-resume": Case(
        _stale_resume,
        "resumes from a checkpoint other than the model's last save (line 53): step: resumed "
        "1 | model 2",
        {"crash_at": 20.0},
        ends=True,
    ),
    "resume-from-a-later-step": Case(
        _set(_resume_line, "step", 3),
        "resumes from a checkpoint other than the model's last save (line 53): step: resumed "
        "3 | model 2",
        {"crash_at": 20.0},
        ends=True,
    ),
    "fresh-start-after-a-checkpoint": Case(
        _fresh_start_after_a_checkpoint, "started from scratch", {"crash_at": 20.0}
    ),
    "another-run": Case(
        _set(_restart_header, "routing", [0] * (PROMPTS - 1) + [1]),
        "describes another run than line 1's (routing differ)",
        {"crash_at": 15.0},
    ),
    "action-after-a-crash-line": Case(
        _action_after_a_crash_line, "a 'action' line after incarnation 0's crash line (line"
    ),
    "another-incarnation": Case(
        _set(_first_commit, "incarnation", 1),
        "the line says incarnation 1, the header before it began incarnation 0",
    ),
    # one name sorting before each known type and one after them all: a line type is
    # matched whole, not by its place in the alphabet
    **{
        f"unknown-line-type-{kind}": Case(
            _set(_first_commit, "type", kind), f"unknown line type {kind!r}"
        )
        for kind in ("abort", "comment", "debug", "warning")
    },
    "a-line-of-an-earlier-incarnation": Case(
        _set(_first_after_the_resume, "incarnation", 0),
        "the line says incarnation 0, the header before it began incarnation 1",
        {"crash_at": 20.0},
    ),
    "a-line-without-an-incarnation": Case(
        _drop(_first_commit, "incarnation"),
        "the line says incarnation None, the header before it began incarnation 0",
    ),
    "first-header-without-an-incarnation": Case(
        _drop(lambda lines: 0, "incarnation"), "the first header is incarnation None, not 0"
    ),
    "an-incarnation-repeated": Case(
        _set(_restart_header, "incarnation", 0),
        "the header says incarnation 0, the next is 1",
        {"crash_at": 20.0},
    ),
    "a-third-header-repeats-the-second": Case(
        _bare_header_before_the_restart,
        "the header says incarnation 1, the next is 2",
        {"crash_at": 20.0},
    ),
    "given-up-after-it-was-trained": Case(
        _given_up_after_it_was_trained, "prompt 0 given up after it was settled at line 24"
    ),
    "given-up-twice": Case(
        _given_up_twice,
        "given up after it was settled at line",
        FAULTS,
    ),
    "a-given-up-prompt-lost": Case(
        _set(_given_up(46), "given_up", []),
        "the trace says it gave up prompts [], the model gave up [46] (prompts [46] given up "
        "but lost from the trace)",
        FAULTS,
        ends=True,
    ),
    "another-prompt-given-up": Case(
        _set(_given_up(46), "given_up", [47]),
        "the trace says it gave up prompts [47], the model gave up [46] (prompts [46] given "
        "up but lost from the trace)",
        FAULTS,
        ends=True,
    ),
    "unknown-action": Case(
        _set(_first_commit, "kind", "teleport"),
        "not an action the model knows: \"kind\" 'teleport' is none of the model's",
    ),
    "a-kind-that-is-a-list": Case(
        _set(_first_commit, "kind", [1]),
        'not an action the model knows: "kind" [1] is none of the model\'s',
    ),
    "an-ordinal-not-a-number": Case(
        _set(_first_commit, "ordinal", "x"),
        "not an action the model knows: \"ordinal\" must be a whole number, got 'x'",
    ),
    "a-lane-of-true": Case(
        _set(_first_commit, "lane", True),
        'not an action the model knows: "lane" must be a whole number, got True',
    ),
    "first-header-not-zero": Case(
        _first_header_not_zero, "the first header is incarnation 1, not 0"
    ),
    "restart-in-an-older-format": Case(
        _set(_restart_header, "format", 0), "trace format 0, not 1", {"crash_at": 20.0}
    ),
    "restart-in-a-newer-format": Case(
        _set(_restart_header, "format", 2), "trace format 2, not 1", {"crash_at": 20.0}
    ),
    "an-incarnation-skipped": Case(
        _set(_restart_header, "incarnation", 2),
        "the header says incarnation 2, the next is 1",
        {"crash_at": 20.0},
    ),
    "resume-twice": Case(
        _resume_twice, "a resume line after the incarnation's first action", {"crash_at": 20.0}
    ),
    "resume-without-a-step": Case(
        _resume_without_a_step, "the resume line needs a step and a ledger", {"crash_at": 20.0}
    ),
    "resume-ledger-without-a-cursor": Case(
        _resume_ledger_without_a_cursor,
        "the resume line's ledger lacks 'cursor'",
        {"crash_at": 20.0},
    ),
    "resume-with-nothing-saved": Case(
        _resume_with_nothing_saved,
        "incarnation 1 resumes from the checkpoint of step 0, but the model has saved none",
        {"crash_at": 3.0},
    ),
    "given-up-as-it-is-trained": Case(
        _given_up_as_it_is_trained, "given up after it was settled at line"
    ),
    "given-up-not-by-the-model": Case(
        _set(_first_trained, "given_up", [PROMPTS - 1]),
        f"the trace says it gave up prompts [{PROMPTS - 1}], the model gave up []",
        ends=True,
    ),
    "unknown-outcome": Case(
        _set(_end_line, "outcome", "done"), "the end line's outcome 'done' is not 'ok'"
    ),
    "end-before-the-exit": Case(
        _end_before_the_exit, "the run says it ended (ok) but it never exited"
    ),
    "stopped-after-every-step": Case(
        _set(_end_line, "outcome", "stopped"),
        "the run says it was stopped early, but in the model it trained every step",
    ),
}


_TRACES: dict[str, str] = {}
"""The untouched trace of each distinct run the cases ask for: the runs are deterministic
(virtual time), so each is run once per test process and every case and seeded bug reads it."""


async def _trace(tmp: Path, **run: Any) -> Lines:
    """The lines of the run `run` describes (see `Case.run`), made once per process."""
    key = repr(sorted(run.items()))
    if key not in _TRACES:
        folder = tmp / f"made-{len(_TRACES)}"
        folder.mkdir()
        if "scenario" in run:
            scenario = load_scenario(run["scenario"])  # the simulator runs its own trio
            await trio.to_thread.run_sync(
                lambda: simulate(scenario, PUMP_DEMAND, trace=folder / "trace.jsonl")
            )
            _TRACES[key] = (folder / "trace.jsonl").read_text()
        else:
            _TRACES[key] = (await traced_run(folder, **run)).trace.read_text()
    return [json.loads(line) for line in _TRACES[key].splitlines()]


async def _judge(tmp: Path, case: Case) -> tuple[ReplayResult, int, Path]:
    """The case's run, traced; the replay of its corrupted trace, the line that must be named,
    and the untouched trace."""
    untouched = write(tmp / "trace.jsonl", await _trace(tmp, **case.run))
    lines = read(untouched)
    broken = case.corrupt(lines)
    return replay(write(tmp / "corrupt.jsonl", lines)), broken + 1, untouched


def _problems(result: ReplayResult, line: int, case: Case) -> list[str]:
    out = []
    if result.verdict != case.verdict:
        out.append(f"verdict {result.verdict}, not {case.verdict}")
    if result.line != line:
        out.append(f"named line {result.line}, not {line}")
    if case.says and case.says not in str(result.problem):
        out.append(f"said {result.problem!r}, not {case.says!r}")
    elif case.ends and not str(result.problem).endswith(case.says):
        out.append(f"said {result.problem!r}, more than {case.says!r}")
    return out


@pytest.mark.parametrize("name", sorted(set(CASES) - {"untouched"}))
async def test_a_corrupted_trace_is_rejected_naming_the_line(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, name: str
) -> None:
    result, line, untouched = await _judge(tmp_path, CASES[name])
    assert replay(untouched).verdict == CASES[name].before  # before the corruption
    assert not _problems(result, line, CASES[name]), result.verdict_line()
    assert result.verdict_line().startswith(f"REJECTED at line {line}: ")


async def test_the_cli_prints_the_rejection_with_the_model_state(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, line, untouched = await _judge(tmp_path, CASES["forbidden-action"])
    before = [x for x in read(untouched)[: line - 1] if x["type"] == "action"]
    # the actions read, up to and with the refused one
    assert result.incarnations[0].actions == result.actions == len(before) + 1
    assert main(["replay", str(tmp_path / "corrupt.jsonl")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"REJECTED at line {line}: the model does not allow")
    assert out[-1].startswith("  model: running step 0")


# -- bad input is refused in one line -----------------------------------------------------------


def _header(tmp: Path, **changes: Any) -> Path:
    header = {
        "type": "header",
        "format": 1,
        "incarnation": 0,
        "config": json.loads(json.dumps(config_json())),
        "prompts": PROMPTS,
        "num_steps": 4,
        "teachers": 1,
        "routing": [0] * PROMPTS,
    }
    header.update(changes)
    return write(tmp / "t.jsonl", [header])


def config_json() -> dict[str, Any]:
    from groupflow.impl._pipeline import config_to_json

    return config_to_json(config())


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (lambda tmp: tmp / "missing", TraceNotFound, "'{tmp}/missing' does not exist"),
        (lambda tmp: tmp, TraceNotFound, "is a folder without a trace (trace.jsonl)"),
        (lambda tmp: write(tmp / "t.jsonl", []), TraceCorrupt, "is empty"),
        (
            lambda tmp: (
                tmp.joinpath("t.jsonl").write_text("step,loss\n1,0.5\n") and tmp / "t.jsonl"
            ),
            TraceCorrupt,
            "line 1 is not a JSON object with a type: not a groupflow trace (JSON lines): 'step,loss'",
        ),
        (
            lambda tmp: tmp.joinpath("t.jsonl").write_text("a" * 100) and tmp / "t.jsonl",
            TraceCorrupt,
            f"not a groupflow trace (JSON lines): {'a' * 80!r}",
        ),
        (lambda tmp: _header(tmp, format=7), TraceCorrupt, "trace format 7 is not one this"),
        (lambda tmp: _header(tmp, num_steps=2), TraceCorrupt, "trains 2 of the 4 steps"),
        (
            lambda tmp: write(tmp / "t.jsonl", [{"type": "action", "kind": "admit"}]),
            TraceCorrupt,
            "line 1 is a 'action' line, not a header",
        ),
        (
            lambda tmp: write(tmp / "t.jsonl", [{"type": "resume", "step": 1, "ledger": {}}]),
            TraceCorrupt,
            "line 1 is a 'resume' line, not a header",
        ),
    ],
    ids=[
        "missing",
        "folder",
        "empty",
        "csv",
        "long-text",
        "format",
        "num-steps",
        "headless",
        "resume-first",
    ],
)
def test_bad_input_is_refused_in_one_line_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], Path],
    error: type[Exception],
    says: str,
) -> None:
    path = make(tmp_path)
    with pytest.raises(error) as info:
        replay(path)
    assert says.format(tmp=tmp_path) in str(info.value)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("groupflow replay: ")


# -- seeded bugs: the replay's own checks matter ------------------------------------------------


@contextmanager
def _seeded(name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        walk = replay_module._Replay
        if name == "no-ordinal-accounting":
            m.setattr(walk, "account", lambda self, number, trained, given_up: None)
            m.setattr(walk, "unaccounted", lambda self: [])
        elif name == "no-agreement-with-the-model":
            m.setattr(walk, "agree", lambda self, *args: None)
        elif name == "no-model-check":
            real = model_step

            def lenient(state: Any, bounds: Any, action: Any) -> Any:
                step = real(state, bounds, action)
                if step.allowed:
                    return step
                return attrs.evolve(step, state=transition(state, bounds, action), allowed=True)

            m.setattr(replay_module, "model_step", lenient)
        elif name == "no-resume-check":
            m.setattr(
                walk, "resume", lambda self, number, data: setattr(self, "expect_resume", False)
            )
        elif name == "no-end-check":
            m.setattr(walk, "end", lambda self, number, data: setattr(self, "ended", "ok"))
        else:
            raise AssertionError(name)
        yield


SEEDED = [
    "no-ordinal-accounting",
    "no-agreement-with-the-model",
    "no-model-check",
    "no-resume-check",
    "no-end-check",
]


@pytest.mark.parametrize("bug", SEEDED)
async def test_each_seeded_bug_in_the_replay_is_caught(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bug: str,
) -> None:
    caught = []
    for name, case in CASES.items():  # the untouched trace too: it must stay valid
        folder = tmp_path / name
        folder.mkdir()
        with _seeded(bug, monkeypatch):
            try:
                result, line, _ = await _judge(folder, case)
            except Exception as exc:  # a replay broken this way may also crash outright
                caught.append(f"{name}: raised {exc!r}")
                continue
        problems = _problems(result, line, case)
        if problems:
            caught.append(f"{name}: {problems}")
    assert caught, f"no case caught the seeded bug {bug!r}"
    print(f"{bug}: caught by", *caught, sep="\n  ")


def test_groupflow_sim_writes_a_trace_that_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "faults.jsonl"
    assert main(["sim", "--scenario", "faults", "--design", "pump", "--trace", str(path)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    assert "2 incarnations, 1 crash, resumed from step" in capsys.readouterr().out
    assert main(["sim", "--design", "both", "--trace", str(tmp_path / "two.jsonl")]) == 2
    assert "pick one --design" in capsys.readouterr().err


# -- a header with nothing after it ---------------------------------------------------------


async def test_a_trace_ending_in_a_bare_restart_header_is_incomplete_not_a_crash(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process that wrote its header and stopped (a start refused by an older groupflow, a
    crash as it started) leaves a header with nothing after it: replay says so, and
    `sim --from-run` refuses to fit it, in one line naming the file and the line."""
    run = await traced_run(tmp_path, crash_at=15.0)
    lines = read(run.trace)
    header = {**lines[0], "incarnation": 2}
    write(run.trace, [*lines, header])
    result = replay(run.trace)
    assert result.verdict == INCOMPLETE, result.verdict_line()
    assert "ends in incarnation 2's header" in str(result.problem)
    assert main(["replay", str(run.trace)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    args = ["sim", "--from-run", str(run.trace)]
    assert await trio.to_thread.run_sync(main, args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{run.trace}: line {len(lines) + 1}: cannot fit this trace (INCOMPLETE" in line


async def test_a_bare_header_between_incarnations_is_a_note(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, crash_at=15.0)
    lines = read(run.trace)
    second = _index(lines, lambda line: line["type"] == "header", 1)
    bare = {**lines[second]}
    later = [
        {**line, "incarnation": line["incarnation"] + 1} if line.get("incarnation") else line
        for line in lines[second:]
    ]
    write(run.trace, [*lines[:second], bare, *later])
    result = replay(run.trace)
    assert result.ok, result.verdict_line()
    assert any("wrote nothing after its header" in note for note in result.notes)


async def test_a_refused_resume_writes_no_trace_line(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The header is written with the first line after it: a pipeline whose resume is refused
    leaves the trace as it was."""
    run = await traced_run(tmp_path, crash_at=15.0, resume=False)
    before = run.trace.read_bytes()
    other = build(tmp_path, run, config(prompts_per_step=2))
    with pytest.raises(ValueError, match="prompts_per_step"):
        await other.resume_from(load_checkpoint(tmp_path / "run-0"))
    assert other.trace is not None
    other.trace.close()
    assert run.trace.read_bytes() == before


# -- what a result says --------------------------------------------------------------------


def _result(
    verdict: str, *, prompts: int = 4, trained: tuple[int, ...] = (), **more: Any
) -> ReplayResult:
    fields: dict[str, Any] = dict(
        path=Path("t.jsonl"),
        verdict=json.loads(json.dumps(verdict)),  # as read back: equal, not the same object
        problem="it broke",
        line=7,
        lines=9,
        actions=8,
        incarnations=(Incarnation(0, 1, None, 8, "ok"),),
        prompts=prompts,
        trained=frozenset(trained),
        given_up=frozenset(),
    )
    fields.update(more)
    return ReplayResult(**fields)


def test_a_result_is_ok_only_when_valid_and_names_the_line_only_when_rejected() -> None:
    assert [_result(v).ok for v in (VALID, REJECTED, INCOMPLETE, FAILED)] == [
        True,
        False,
        False,
        False,
    ]
    assert _result(VALID).verdict_line().startswith("VALID: t.jsonl conforms to the model")
    assert _result(REJECTED).verdict_line() == "REJECTED at line 7: it broke"
    assert _result(INCOMPLETE).verdict_line() == "INCOMPLETE: it broke"
    assert _result(FAILED).verdict_line() == "FAILED: it broke"


def test_a_result_summary_counts_crashes_resumes_and_open_prompts() -> None:
    crashed = Incarnation(0, 1, None, 5, None)
    resumed = Incarnation(1, 7, 1, 3, None)
    last = Incarnation(2, 12, 2, 4, "ok")
    three = _result(VALID, incarnations=(crashed, resumed, last), trained=(0, 1, 2, 3))
    assert three.summary() == (
        "9 lines, 8 actions, 3 incarnations, 2 crashes, resumed from step 1, 2; "
        "4 prompts: 4 trained, 0 given up, 0 open"
    )
    # the last incarnation without an end line is still running as far as the trace shows
    two = _result(INCOMPLETE, incarnations=(crashed, resumed), trained=(1,))
    assert "2 incarnations, 1 crash, resumed from step 1; " in two.summary()
    one = _result(INCOMPLETE, prompts=3, incarnations=(crashed,), given_up=frozenset({2}))
    assert one.open == (0, 1)
    assert one.summary().endswith(
        "1 incarnation, 0 crashes; 3 prompts: 0 trained, 1 given up, 2 open (0, 1)"
    )


def test_a_result_summary_lists_twelve_open_prompts_at_most() -> None:
    twelve = _result(INCOMPLETE, prompts=12).summary()
    assert twelve.endswith("12 open (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)")
    thirteen = _result(INCOMPLETE, prompts=13).summary()
    assert thirteen.endswith("13 open (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...)")


def test_a_rejected_first_header_leaves_no_incarnation(tmp_path: Path) -> None:
    result = replay(_header(tmp_path, incarnation=3))
    assert result.verdict == REJECTED and result.line == 1, result.verdict_line()
    assert result.incarnations == () and "0 incarnations, 0 crashes" in result.summary()


# -- restarts -------------------------------------------------------------------------------


async def test_each_incarnation_counts_its_own_actions(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    lines = await _trace(tmp_path, crash_at=20.0)
    result = replay(write(tmp_path / "t.jsonl", lines))
    assert result.ok, result.verdict_line()
    per = [sum(1 for x in lines if x["type"] == "action" and x["incarnation"] == n) for n in (0, 1)]
    assert [i.actions for i in result.incarnations] == per and sum(per) == result.actions
    assert [i.line for i in result.incarnations] == [1, _restart_header(lines) + 1]
    assert [i.resumed_from for i in result.incarnations] == [None, 2]


async def test_a_run_restarted_hundreds_of_times_replays(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Incarnation numbers are compared as numbers at any size (300 processes that died as
    they started, then one that ran the whole run)."""
    lines = await _trace(tmp_path)
    header, rest = lines[0], lines[1:]
    bare = [{**header, "incarnation": n} for n in range(1, 301)]
    last = [{**line, "incarnation": 300} for line in rest]
    result = replay(write(tmp_path / "t.jsonl", [header, *bare, *last]))
    assert result.ok, result.verdict_line()
    assert len(result.incarnations) == 301 and result.incarnations[-1].actions == len(rest) - 1
    assert "301 incarnations, 300 crashes; " in result.summary()


async def test_an_incarnation_that_resumed_then_died_is_a_crash_not_a_bare_header(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A resume line is the incarnation's first line: one that died right after it did
    something (it restarted from the checkpoint), so no note calls it bare."""
    lines = await _trace(tmp_path, crash_at=20.0)
    resume = _resume_line(lines)
    alone = replay(write(tmp_path / "alone.jsonl", lines[: resume + 1]))
    assert alone.verdict == INCOMPLETE and "has no end line" in str(alone.problem)
    assert alone.incarnations[-1].resumed_from == 2
    again = [{**line, "incarnation": line["incarnation"] + 1} for line in lines[resume - 1 :]]
    result = replay(write(tmp_path / "again.jsonl", lines[: resume + 1] + again))
    assert result.ok, result.verdict_line()
    assert not any("wrote nothing after its header" in note for note in result.notes)
    assert "3 incarnations, 2 crashes" in result.summary()


async def test_a_run_stopped_by_the_user_is_incomplete_and_its_resume_valid(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, stop_at=10.0)
    result = replay(run.trace)
    assert result.verdict == INCOMPLETE, result.verdict_line()
    assert result.problem == (
        "the run was stopped at step 1 of 4 (a user's stop, not a failure): resume it to "
        "finish; what it traced conforms to the model"
    )
    assert result.incarnations[0].outcome == "stopped"
    pipeline = build(tmp_path, run, config())
    with trio.fail_after(10_000):
        await pipeline.resume_from(load_checkpoint(tmp_path / "run-0"))
        await pipeline.run()
    resumed = replay(run.trace)
    assert resumed.ok, resumed.verdict_line()
    assert "2 incarnations, 0 crashes, resumed from step 1; " in resumed.summary()


# -- a crash while a checkpoint is written ---------------------------------------------------


def _cut_in_the_write(lines: Lines) -> Lines:
    """Incarnation 0 up to the snapshot of its last checkpoint: it died as that was written."""
    restart = _restart_header(lines)
    last_save = max(
        i for i, line in enumerate(lines[:restart]) if line.get("kind") == "checkpoint_saved"
    )
    assert lines[last_save + 1]["kind"] == "checkpoint_written"
    return lines[: last_save + 1]


async def test_a_checkpoint_whose_write_landed_before_the_crash_is_resumed_from(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    lines = await _trace(tmp_path, crash_at=20.0)
    first = _cut_in_the_write(lines)
    result = replay(write(tmp_path / "t.jsonl", first + lines[_restart_header(lines) :]))
    assert result.ok, result.verdict_line()
    assert result.notes == (
        f"incarnation 1 resumes from the checkpoint whose write began at line {len(first)}: it "
        f"reached the disk before its checkpoint_written line did",
    )


async def test_a_checkpoint_whose_write_did_not_land_leaves_the_one_before(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The run died writing step 2's checkpoint and the write never landed: the restart
    resumes from step 1's (the restart of a run that crashed just after step 1's save)."""
    died = _cut_in_the_write(await _trace(tmp_path, crash_at=20.0))
    earlier = await _trace(tmp_path, crash_at=12.0)
    restart = earlier[_restart_header(earlier) :]
    assert restart[1]["type"] == "resume" and restart[1]["step"] == 1
    result = replay(write(tmp_path / "t.jsonl", died + restart))
    assert result.ok, result.verdict_line()
    assert not result.notes
    # a resume past both: the model's last save is still step 1's (line 33), not the one
    # being written
    restart[1] = {**restart[1], "step": 3}
    past = replay(write(tmp_path / "past.jsonl", died + restart))
    assert past.verdict == REJECTED and past.line == len(died) + 2, past.verdict_line()
    assert str(past.problem).endswith(
        "other than the model's last save (line 33): step: resumed 3 | model 1"
    )


async def test_a_fresh_start_names_the_last_save_not_the_write_in_flight(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Under `uncommitted`, rollouts go on while a snapshot is written: the last save the
    model restarts from is the one written before, at its own line."""
    lines = await _trace(tmp_path, policy="uncommitted", crash_at=20.0)
    saves = [i for i, line in enumerate(lines) if line.get("kind") == "checkpoint_saved"]
    written, writing = saves[0], saves[1]  # step 1's save, step 2's
    assert lines[writing + 1]["kind"] == "checkpoint_written"
    # what the run went on doing after step 2's write (trio's scheduling orders it), moved
    # into the write: the crash comes with step 2's checkpoint still being written
    meanwhile = list(
        itertools.takewhile(
            lambda line: line.get("kind") in {"admit", "commit", "scored", "dispatch"},
            lines[writing + 2 :],
        )
    )
    assert meanwhile and written < writing
    moved = [*lines[: writing + 1], *meanwhile]
    restart = _restart_header(lines)
    fresh = [lines[restart], lines[restart + 2]]  # no resume line
    result = replay(write(tmp_path / "t.jsonl", moved + fresh))
    assert result.verdict == REJECTED and result.line == len(moved) + 2, result.verdict_line()
    assert str(result.problem).endswith(
        f"started from scratch, but the model restarts from the checkpoint of step 1 (saved "
        f"at line {written + 1}): resume from it"
    )
    assert "(header at line" in str(result.problem)


# -- what a line need not say, and what the model itself breaks ------------------------------


async def test_a_trace_without_group_states_replays(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A writer without the buffer leaves out where each group moved (`to`): the rest is
    checked as ever."""
    lines = [{k: v for k, v in line.items() if k != "to"} for line in await _trace(tmp_path)]
    result = replay(write(tmp_path / "t.jsonl", lines))
    assert result.ok, result.verdict_line()


async def test_an_invariant_the_model_breaks_is_reported_at_its_line(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = await _trace(tmp_path)
    commit = _first_commit(lines)

    def breaking(state: Any, bounds: Any, action: Any) -> Any:
        step = model_step(state, bounds, action)
        if action.kind == "commit":
            return attrs.evolve(step, violations=("one thing", "another"))
        return step

    monkeypatch.setattr(replay_module, "model_step", breaking)
    result = replay(write(tmp_path / "t.jsonl", lines))
    assert result.verdict == REJECTED and result.line == commit + 1, result.verdict_line()
    assert str(result.problem).endswith("the model's invariants fail: one thing; another")
    assert str(result.problem).startswith("after ")
