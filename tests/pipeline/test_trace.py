"""The trace writer: `build_pipeline(trace=...)` appends every action the run reports, in the
line format `groupflow replay` reads, beside any observer; restarts append to the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl import ScoringConfig, TraceWriter
from groupflow.impl._pipeline import (
    TRACE_FILE,
    TRACE_FORMAT,
    Checkpointer,
    config_from_json,
    config_to_json,
)
from groupflow.impl._pipeline._part_checks import tokens_of
from groupflow.impl.errors import ConfigError, TraceCorrupt
from groupflow.model import GroupState
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.sim.verify.conformance import Conformance, bounds_for
from groupflow.sim.verify.replay import replay
from tests.traced import PROMPTS, TracedRun, build, config, read, traced_run

_STATES = {s.value for s in GroupState}


async def test_every_action_is_a_line_beside_the_conformance_check(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path)
    assert run.checker.ok, run.checker.failure
    lines = read(run.trace)
    header, *actions, end = lines
    assert header["type"] == "header" and header["format"] == TRACE_FORMAT
    assert header["incarnation"] == 0 and header["prompts"] == PROMPTS
    assert header["num_steps"] == 4 and header["teachers"] == 1
    assert header["routing"] == [0] * PROMPTS and header["lanes"] == {"teacher": 0}
    assert config_to_json(config_from_json(header["config"])) == config_to_json(config())
    # the checker and the trace heard the same actions, in the same order
    assert [a["kind"] for a in actions] == [str(a.kind) for a in run.checker.trace]
    for line in actions:
        assert line["type"] == "action" and line["incarnation"] == 0
        assert ActionKind(line["kind"])
        assert isinstance(line["time"], float) and {"step", "version"} <= set(line)
        if "group" in line:
            assert line["to"] in _STATES and (line["from"] is None or line["from"] in _STATES)
    admits = [a for a in actions if a["kind"] == "admit"]
    assert [a["ordinal"] for a in admits] == list(range(PROMPTS))
    assert all(a["from"] is None and a["to"] == "RESERVED" for a in admits)
    commits = [a for a in actions if a["kind"] == "commit"]
    assert all(a["from"] == "RESERVED" and a["to"] == "WRITTEN" for a in commits)
    # each row's input_ids is [ordinal, i]: two tokens a row, added up over the group's rows
    generations = config().shape.num_generations_per_prompt
    assert [a["tokens"] for a in commits] == [2 * generations] * len(commits)
    assert all("tokens" not in a for a in actions if a["kind"] != "commit")
    trained = [o for a in actions for o in a.get("trained", [])]
    assert sorted(trained) == list(range(PROMPTS))
    assert [a["version"] for a in actions if a["kind"] == "trained"] == [1, 2, 3, 4]
    times = [a["time"] for a in actions]
    assert times == sorted(times) and times[-1] > 0
    assert end == {**end, "type": "end", "outcome": "ok", "trained": PROMPTS, "given_up": 0}


async def test_a_restart_appends_a_new_incarnation_with_its_resume(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, crash_at=15.0)
    assert run.crashed and run.resumed and run.checker.ok, run.checker.failure
    lines = read(run.trace)
    headers = [i for i, line in enumerate(lines) if line["type"] == "header"]
    assert [lines[i]["incarnation"] for i in headers] == [0, 1]
    resume = lines[headers[1] + 1]
    assert resume["type"] == "resume" and resume["incarnation"] == 1 and resume["step"] >= 1
    assert set(resume["ledger"]) == {"cursor", "trained", "shortfall", "saved", "reissue"}
    assert "run-0" in resume["checkpoint"]
    # the crashed incarnation wrote no last words and no end line
    before = lines[: headers[1]]
    assert not any(line["type"] == "end" for line in before)
    assert [line["type"] for line in lines].count("end") == 1
    assert all(line["incarnation"] == 1 for line in lines[headers[1] :])


async def test_a_failed_run_ends_its_trace_as_failed(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    run = await traced_run(tmp_path, fail_steps=frozenset({1}))
    assert run.failed
    end = read(run.trace)[-1]
    assert end["type"] == "end" and end["outcome"] == "failed"
    assert "PumpFailed" in end["error"] and end["trained"] == 4


async def test_a_run_cancelled_from_outside_ends_its_trace_with_a_crash_line(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Cancelling a run from outside is a crash to the model: the writer sees the run report a
    shutdown action (a cancelled rollout) it never began, writes one `crash` line, and then
    nothing of what the dying run reports on its way out (no exit, no end line)."""
    cfg = config()
    run = TracedRun(tmp_path / "trace.jsonl", Conformance(bounds_for(cfg, prompts=PROMPTS)))
    pipeline = build(tmp_path, run, cfg)
    with trio.move_on_after(5.0):
        await pipeline.run()
    lines = read(run.trace)
    assert lines[-1]["type"] == "crash" and "cancelled from outside" in lines[-1]["reason"]
    kinds = [line.get("kind") for line in lines]
    assert "exit" not in kinds and "cancel" not in kinds
    assert pipeline.trace is not None and pipeline.trace.closed


def test_the_next_incarnation_ends_a_line_a_crash_cut_short(tmp_path: Path) -> None:
    path = tmp_path / TRACE_FILE
    first = TraceWriter.open(tmp_path, header={"prompts": 1})
    assert first.path == path and first.incarnation == 0
    first.end("ok", trained=0, given_up=0)
    header = path.read_text().splitlines()[0]
    path.write_text(header + "\n" + '{"type":"action","incarnation":0,"kind":"adm')  # died here
    second = TraceWriter.open(path, header={"prompts": 1})
    second.end("ok", trained=0, given_up=0)
    text = path.read_text().splitlines()
    assert text[1].endswith('"kind":"adm')
    assert json.loads(text[2])["type"] == "header" and json.loads(text[2])["incarnation"] == 1
    assert json.loads(text[3])["type"] == "end"


def test_each_line_reaches_the_file_when_it_is_written(tmp_path: Path) -> None:
    """Line-buffered: a crash right after a line loses nothing of it (no close, no flush)."""
    writer = TraceWriter.open(tmp_path / "t.jsonl", header={})
    writer.end("ok", trained=0, given_up=0)  # closes: what is on disk is what a crash leaves
    assert len(read(tmp_path / "t.jsonl")) == 2
    assert (tmp_path / "t.jsonl").read_text().endswith("\n")
    assert writer.lines == 2


def test_the_header_waits_for_the_first_line_after_it(tmp_path: Path) -> None:
    """A run refused before its first action (a resume whose checkpoint does not fit) leaves
    the trace as it was: the header is written with the first line after it."""
    path = tmp_path / "t.jsonl"
    path.write_text("")
    TraceWriter.open(path, header={}).close()
    assert path.read_text() == ""
    TraceWriter.open(path, header={}).end("ok", trained=0, given_up=0)
    assert [line["type"] for line in read(path)] == ["header", "end"]


# -- written in batches (`write_in_batches`, what `groupflow train` does) ----------------


@pytest.mark.parametrize("crash_at", [None, 15.0])
async def test_a_trace_written_in_batches_holds_every_line_and_replays(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, crash_at: float | None
) -> None:
    run = await traced_run(tmp_path, crash_at=crash_at, batch_s=0.5)
    assert run.checker.ok, run.checker.failure
    lines = read(run.trace)
    assert len(lines) == sum(p.trace.lines for p in run.pipelines if p.trace is not None) > 20
    if crash_at is None:
        actions = [line["kind"] for line in lines if line["type"] == "action"]
        assert actions == [str(a.kind) for a in run.checker.trace]
    else:
        assert run.resumed
    verdict = replay(run.trace)
    assert verdict.verdict == "valid", verdict.problem
    assert verdict.trained == frozenset(range(PROMPTS))


async def test_a_batched_trace_holds_each_checkpoint_save_before_its_files_are_written(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int, int]] = []
    original = Checkpointer._write
    path = tmp_path / "trace.jsonl"

    def write(self: Checkpointer, *args: Any) -> Path:
        lines = read(path)
        writer = [p.trace for p in pipelines if p.checkpointer is self][0]
        assert writer is not None
        seen.append((lines[-1].get("kind", ""), len(lines), writer.lines))
        return original(self, *args)

    monkeypatch.setattr(Checkpointer, "_write", write)
    cfg = config()
    run = TracedRun(path, Conformance(bounds_for(cfg, prompts=PROMPTS)))
    pipelines = [build(tmp_path, run, cfg, batch_s=3600.0)]
    await pipelines[0].run()
    assert len(seen) >= 3
    for kind, in_file, recorded in seen:
        assert kind in ("checkpoint_saved", "flush_timeout") and in_file == recorded


def test_batched_lines_reach_the_file_a_batch_after_the_first_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter.open(path, header={})
    writer.write_in_batches(0.05)

    async def main() -> None:
        writer.record(Action(ActionKind.ADMIT, 0))
        assert len(read(path)) == 1  # kept: only the header is written, with the first line
        await trio.sleep(0.2)  # the batch's task wakes first and writes it
        assert len(read(path)) == 2
        writer.record(Action(ActionKind.ADMIT, 1))
        writer.record(Action(ActionKind.COMMIT, 1))
        assert len(read(path)) == 2
        writer.crash()  # a crash writes what was recorded before it, and nothing after
        writer.record(Action(ActionKind.ADMIT, 2))

    # virtual time: the batch's 0.05 s comes before the test's 0.2 s however slow the machine
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [line.get("ordinal") for line in read(path)] == [None, 0, 1, 1]


def test_write_in_batches_refuses_a_batch_of_no_time(tmp_path: Path) -> None:
    writer = TraceWriter.open(tmp_path / "t.jsonl", header={})
    with pytest.raises(ConfigError, match="seconds must be > 0"):
        writer.write_in_batches(0)
    writer.close()


def test_a_trace_in_a_folder_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace=.*does not exist") as info:
        TraceWriter.open(tmp_path / "nope" / "t.jsonl", header={})
    assert info.value.field == "trace"


def test_the_config_survives_the_header() -> None:
    cfg = config(
        "uncommitted",
        gate_window=2,
        stall_timeout_s=1e9,
        scoring=ScoringConfig(flush_after_s=2.0, dispatch="timer", failure_policy="discard"),
    )
    data = json.loads(json.dumps(config_to_json(cfg)))
    assert data["checkpoints"]["policy"] == "uncommitted"
    assert data["scoring"]["dispatch"] == "timer"
    assert "folder" not in data["checkpoints"], "where it writes is not what the run is"
    assert cfg.checkpoints is not None
    unrecorded = attrs.evolve(cfg.checkpoints, folder="(not recorded)", write_in_thread=True)
    assert config_from_json(data) == attrs.evolve(cfg, checkpoints=unrecorded)


def test_a_header_whose_config_has_fields_this_version_lacks_is_refused_naming_them() -> None:
    """A header that keeps its checkpoint fields at the top of the config (as no release
    writes) is refused as corrupt, never read as a run without checkpoints."""
    current = config_to_json(config("uncommitted"))
    other = {k: v for k, v in current.items() if k != "checkpoints"}
    other |= {"checkpoint_every_steps": 1, "keep_checkpoints": None}
    with pytest.raises(
        TraceCorrupt, match=r"fields \['checkpoint_every_steps', 'keep_checkpoints'\]"
    ):
        config_from_json(other)


@pytest.mark.parametrize(
    ("rows", "tokens"),
    [
        ([{"input_ids": [1, 2, 3]}, {"input_ids": (4,)}], 4),
        ([{"input_ids": [1, 2, 3]}, {"prompt": "no ids"}], None),
        ([{"input_ids": "text, not token ids"}], None),
        ([], 0),
    ],
)
def test_a_groups_tokens_are_its_rows_input_ids_added_up(
    rows: list[dict[str, Any]], tokens: int | None
) -> None:
    """What a commit line records as `tokens`: left out where a row has no token ids."""
    assert tokens_of(rows) == tokens
