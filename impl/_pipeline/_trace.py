"""The trace: every action a run reports, one JSON line each, for `groupflow replay`.

A run's conformance check (`groupflow.sim.verify.conformance`) needs the live pipeline beside it; a
trace lets the same model judge a run afterwards, from a file, across crashes. So it records
what the model needs and nothing it could recompute: the header carries what rebuilds the
model's `Bounds` (config, prompts, routing, teachers), each action line the action in the
model's vocabulary plus the group it moved, its states, the train position and the time (and
on a commit the group's tokens, where its rows have `input_ids`), a resume line the checkpoint
the run restarted from, and an end line that the run ended by itself. A crash is the absence
of an end line before the next incarnation's header.

Writes are line-buffered: each line reaches the operating system when it is complete, so a
crash leaves at most a truncated last line, and the next incarnation ends that line before its
header. Writing is synchronous (a `write` into the page cache, never an fsync): a few
microseconds per action, against trio's scheduling of the same action (see
`bench/trace_cost.py`), so it stays on by default rather than in a worker thread that would
reorder lines.

Each `write` releases the GIL, though, and where worker threads hold it (a trainer sampling
and scoring in threads) trio's thread waits to take it back: about 100 microseconds a line in
`groupflow train` (`bench/trainer_profile.py`). `TraceWriter.write_in_batches` trades the
line-by-line writes for one `write` per batch: lines are kept in the file's buffer and
written by a trio system task the batch's seconds after the first of them was kept; at once
before a checkpoint's files are written (with its `checkpoint_saved` or `flush_timeout` line:
a checkpoint is never ahead of its trace); with the resume, end and crash lines; and at close.
The lines are the same; a process killed outright loses at most the last batch, none of it a
checkpoint's.

Line kinds (`"type"`): `header`, `resume`, `action`, `end`, and `crash` for a run cancelled
from outside (an enclosing cancel scope, Ctrl-C) while it was running: the writer sees the run
report a shutdown action it never began, says so, and writes nothing more, since the rest of
what the dying run reports is not the model's. Every line carries its `incarnation` (0 for a
fresh run, one more per restart appended to the same file).
"""

from __future__ import annotations

import enum
import io
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from groupflow.impl._core import ReplayBuffer
from groupflow.impl._pipeline._checkpoint import Checkpoint
from groupflow.impl._pipeline._config import (
    CheckpointConfig,
    PipelineConfig,
    ScoringConfig,
)
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._rollout import TrainPosition
from groupflow.model.errors import ConfigError, TraceCorrupt
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.shape import Shape
from groupflow.model.states import GroupState

TRACE_FORMAT = 1
"""The version of the line format; `groupflow replay` refuses one it does not know."""
TRACE_FILE = "trace.jsonl"
"""The trace's name inside a run folder (`build_pipeline(trace=folder)`)."""

_HEADER_PREFIX = '{"type":"header"'
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_FROM_BY_KIND = {
    ActionKind.ADMIT: None,
    ActionKind.COMMIT: GroupState.RESERVED,
    ActionKind.ROLLOUT_FAIL: GroupState.RESERVED,
    ActionKind.CANCEL: GroupState.RESERVED,
}
"""The state each per-group action moves its group from, where the kind alone says it (a drop
says it with the report: WRITTEN or SCORING)."""
_TEARDOWN_KINDS = frozenset(
    {ActionKind.CANCEL, ActionKind.DROP, ActionKind.TRAIN_CANCELLED, ActionKind.EXIT}
)
"""Actions a run takes only once it shuts down (trained its steps, was stopped, or failed).
Reported by a run that did none of these, they are its teardown from outside (an enclosing cancel scope, Ctrl-C):
to the model that is a crash, and what the run reports on its way out is not the model's."""
_WRITE_AT_ONCE = frozenset({ActionKind.CHECKPOINT_SAVED, ActionKind.FLUSH_TIMEOUT})
"""Actions after which a checkpoint's files are written: a batched trace writes these lines
(and what it kept before them) at once, so the trace always holds the checkpoint's save."""
_UNSERIALIZED = frozenset({"transient_errors"})
"""Config fields that are classes, not values: recorded by name, not rebuilt (the model does
not read them)."""


def trace_path(path: Path) -> Path:
    """The trace file `path` names: a folder holds it as `TRACE_FILE`."""
    path = Path(path)
    return path / TRACE_FILE if path.is_dir() else path


def _now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio (the pipeline is built before the run starts)
        return None


def _plain(value: object) -> object:
    if isinstance(value, tuple) and all(isinstance(v, type) for v in value):
        return [f"{v.__module__}.{v.__qualname__}" for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


_NOT_RECORDED = "(not recorded)"
"""The folder of a config read from a trace."""


_WHERE_NOT_WHAT = frozenset({"folder", "write_in_thread"})
"""`CheckpointConfig` fields that say where and how this process writes, not what the run is:
a resume may read its checkpoint from another folder, and the trace is still one run's."""


def config_to_json(config: PipelineConfig) -> dict[str, Any]:
    """`config` as plain JSON values (enums by value, exception classes by name; a config holds
    no infinities, its seconds are finite), without where its checkpoints are written."""

    def fields(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in attrs.fields(type(obj)):
            if isinstance(obj, CheckpointConfig) and field.name in _WHERE_NOT_WHAT:
                continue
            value = getattr(obj, field.name)
            out[field.name] = fields(value) if attrs.has(type(value)) else _plain(value)
        return out

    return fields(config)


def config_from_json(data: Mapping[str, Any]) -> PipelineConfig:
    """The config `config_to_json` wrote (the exception classes and the checkpoints' writing
    left at their default, their folder not recorded). Raises `TraceCorrupt` naming the field
    when the values do not make a config."""

    def values(raw: Mapping[str, Any], cls: type[Any]) -> dict[str, Any]:
        names = {f.name: f for f in attrs.fields(cls)}
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise TraceCorrupt(
                f"the header's config has fields {unknown} that {cls.__name__} does not know: "
                f"a trace from another groupflow version?"
            )
        out: dict[str, Any] = {}
        for name, value in raw.items():
            if name in _UNSERIALIZED:
                continue
            out[name] = value
        return out

    try:
        raw = dict(data)
        scoring = raw.pop("scoring", None)
        checkpoints = raw.pop("checkpoints", None)
        shape = raw.pop("shape", None)
        if not isinstance(shape, Mapping):
            raise TraceCorrupt(f"the header's config has no shape table, got {shape!r}")
        return PipelineConfig(
            **values(raw, PipelineConfig),
            shape=Shape(**values(shape, Shape)),
            scoring=None if scoring is None else ScoringConfig(**values(scoring, ScoringConfig)),
            checkpoints=None
            if checkpoints is None
            else CheckpointConfig(
                **{"folder": _NOT_RECORDED, **values(checkpoints, CheckpointConfig)}
            ),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TraceCorrupt):
            raise
        raise TraceCorrupt(f"the header's config is not a PipelineConfig: {exc}") from exc


def _incarnations(path: Path) -> tuple[int, bool]:
    """Headers already in the file, and whether its last line was cut short (a crash)."""
    if not path.exists():
        return 0, False
    headers = 0
    last = ""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(_HEADER_PREFIX):
                headers += 1
            last = line
    return headers, bool(last) and not last.endswith("\n")


@attrs.define(eq=False)
class TraceWriter:
    """Writes one run's trace (an `ActionRecorder` for `RunStatus.recorder`).

    `open` checks where the trace goes and makes the header; the file is appended to (a
    restart's trace follows its crashed predecessor's) from the first line after it, so a run
    refused before it starts (a resume whose checkpoint does not fit) leaves the file as it
    was. The controller binds the buffer and the train position the action
    lines read; `resumed`, `end` and `crash` write or withhold the lines after."""

    path: Path
    incarnation: int
    _header: dict[str, Any] = attrs.field(repr=False)
    _torn: bool = attrs.field(default=False, repr=False)
    """The file ends in a line a crash cut short: it is ended before the header."""
    _file: io.TextIOWrapper | None = attrs.field(default=None, repr=False)
    buffer: ReplayBuffer | None = attrs.field(default=None, repr=False)
    position: TrainPosition | None = attrs.field(default=None, repr=False)
    status: RunStatus | None = attrs.field(default=None, repr=False)
    lines: int = 0
    """Lines this writer has written."""
    closed: bool = False
    _settled: dict[str, list[int]] = attrs.field(factory=dict, repr=False)
    batch_s: float | None = None
    """None: each line is written as it is made (line-buffered, the default). Seconds: lines
    are written in batches (`write_in_batches`)."""
    _kept: bool = attrs.field(default=False, repr=False)
    """In batches: lines are kept that are not written yet."""
    _scheduled: bool = attrs.field(default=False, repr=False)
    """In batches: a system task is to write the lines kept."""
    _failed: OSError | None = attrs.field(default=None, repr=False)
    """A batch's write failed in the system task: raised where the next line is written."""

    @classmethod
    def open(cls, path: Path, *, header: Mapping[str, Any]) -> TraceWriter:
        """Append to the trace at `path` (a file, or a folder that holds `TRACE_FILE`), starting
        with `header` (what rebuilds the model; see `pipeline_header`)."""
        path = trace_path(path)
        if path.parent != Path() and not path.parent.is_dir():
            raise ConfigError(
                f"trace={str(path)!r}: its folder {str(path.parent)!r} does not exist; create "
                f"it or pass another path",
                field="trace",
                config="build_pipeline",
            )
        incarnation, torn = _incarnations(path)
        header = {
            "type": "header",
            "format": TRACE_FORMAT,
            "incarnation": incarnation,
            "time": _now(),
            "wall": time.time(),
            **header,
        }
        return cls(path, incarnation, header, torn)

    def _opened(self) -> io.TextIOWrapper:
        """The file, opened at the first line after the header, the header written first."""
        if self._file is None:
            f = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered
            if self._torn:
                f.write("\n")  # end the line the crash cut short: the header starts its own
            f.write(_JSON.encode(self._header) + "\n")  # on disk at once, batches or not
            self.lines += 1
            if self.batch_s is not None:
                f.reconfigure(line_buffering=False)
            self._file = f
        return self._file

    def write_in_batches(self, seconds: float) -> None:
        """Write lines in batches rather than one by one (see the module's doc): lines are
        written `seconds` after the first of them was kept, and at once with a line that a
        checkpoint follows, with the resume, end and crash lines, and at `close`."""
        if not seconds > 0:
            raise ConfigError(
                f"write_in_batches: seconds must be > 0, got {seconds!r}",
                field="seconds",
                config="TraceWriter",
            )
        self.batch_s = float(seconds)
        if self._file is not None:
            self._file.reconfigure(line_buffering=False)

    def flush(self) -> None:
        """Write the lines kept (in batches) to the file now."""
        self._kept = False
        if not self.closed:
            if self._file is not None:
                self._file.flush()

    def bind(self, buffer: ReplayBuffer, position: TrainPosition, status: RunStatus) -> None:
        """Read group states from `buffer`, the train position from `position`, and from
        `status` whether the run shuts down by itself."""
        self.buffer = buffer
        self.position = position
        self.status = status

    # -- what the pipeline tells it ---------------------------------------------------------

    def settled(self, kind: str, ordinals: Sequence[int]) -> None:
        """The ledger settled `ordinals` (`trained` or `given_up`): recorded with the action
        that did it, which is reported in the same synchronous block."""
        self._settled.setdefault(kind, []).extend(ordinals)

    def record(
        self,
        action: Action,
        *,
        group: str | None = None,
        was: GroupState | None = None,
        tokens: int | None = None,
    ) -> None:
        status = self.status
        if (
            action.kind in _TEARDOWN_KINDS
            and status is not None
            and not (status.stopped or status.failed or status.interrupted)
            and not self.closed
        ):
            self._torn_down(action)
            return
        line: dict[str, Any] = {"type": "action", "incarnation": self.incarnation}
        line.update(action.to_json())
        if group is not None:
            line["group"] = group
            before = _FROM_BY_KIND.get(action.kind, was) if was is None else was
            line["from"] = None if before is None else before.value
            if self.buffer is not None:
                line["to"] = self.buffer.state_of(group).value
        if tokens is not None:
            line["tokens"] = tokens
        position = self.position
        if position is not None:
            line["step"] = position.step
            line["version"] = position.weight_version
        line["time"] = trio.current_time()
        if self._settled:
            line.update(self._settled)
            self._settled = {}
        self._write(line, at_once=action.kind in _WRITE_AT_ONCE)

    def resumed(self, checkpoint: Checkpoint) -> None:
        """The run restarts from `checkpoint`: the replay checks it is the model's last save."""
        ledger = checkpoint.ledger
        self._write(
            {
                "type": "resume",
                "incarnation": self.incarnation,
                "step": checkpoint.step,
                "version": checkpoint.weight_version,
                "checkpoint": str(checkpoint.path),
                "ledger": {
                    key: list(ledger[key]) for key in ("trained", "shortfall", "saved", "reissue")
                }
                | {"cursor": ledger["cursor"]},
                "time": _now(),
            },
            at_once=True,
        )

    def end(self, outcome: str, *, trained: int, given_up: int, error: str | None = None) -> None:
        """The run ended by itself (trained its steps, or failed and shut down): the last line."""
        line: dict[str, Any] = {
            "type": "end",
            "incarnation": self.incarnation,
            "outcome": outcome,
            "trained": trained,
            "given_up": given_up,
            "time": _now(),
        }
        if error is not None:
            line["error"] = error
        if self.position is not None:
            line["step"] = self.position.step
        self._write(line, at_once=True)
        self.close()

    def _torn_down(self, action: Action) -> None:
        """The run is being cancelled from outside while running: one `crash` line says so,
        then nothing more is written."""
        self._write(
            {
                "type": "crash",
                "incarnation": self.incarnation,
                "reason": f"cancelled from outside while running (it reported {action.kind})",
                "time": trio.current_time(),
            },
            at_once=True,
        )
        self.close()

    def crash(self) -> None:
        """The process dies now: nothing more is written (what a cancelled run reports on its
        way out is not the model's). A harness that cancels a run calls this first."""
        self.close()

    def close(self) -> None:
        """Write what is kept and close the file."""
        if not self.closed:
            self.closed = True
            self._kept = False
            if self._file is not None:
                self._file.close()

    def _write(self, line: Mapping[str, Any], *, at_once: bool = False) -> None:
        if self.closed:
            return
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        self._opened().write(_JSON.encode(line) + "\n")
        self.lines += 1
        if self.batch_s is None:
            return
        if at_once:
            self.flush()
            return
        self._kept = True
        if not self._scheduled:
            try:
                trio.lowlevel.spawn_system_task(
                    self._write_later, self.batch_s, name=f"trace {self.path.name}: batch"
                )
            except RuntimeError:  # outside trio: kept until a flush or close
                return
            self._scheduled = True

    async def _write_later(self, seconds: float) -> None:
        """Write the lines kept `seconds` from now (or when the run ends, cancelling this)."""
        try:
            await trio.sleep(seconds)
        finally:
            self._scheduled = False
            if self._kept:
                try:
                    self.flush()
                except OSError as exc:  # a system task must not raise: the next line will
                    self._failed = exc


def pipeline_header(
    config: PipelineConfig,
    *,
    prompts: int,
    num_steps: int,
    routing: Sequence[int],
    lanes: Mapping[str, int],
    stages: int | None = None,
) -> dict[str, Any]:
    """What `groupflow replay` rebuilds the model from (`groupflow.sim.verify.conformance.bounds_for`
    reads the same): the config, the prompts, the steps, each prompt's teacher lane, and the
    number of scoring stages (default: the teacher's alone when the config scores). The
    lanes of the stages after the teacher's come after the teachers' (`lanes_for`)."""
    if stages is None:
        stages = 0 if config.scoring is None else 1
    return {
        "config": config_to_json(config),
        "prompts": prompts,
        "num_steps": num_steps,
        "teachers": max(1, len(lanes) - max(0, stages - 1)),
        "stages": stages,
        "lanes": dict(lanes),
        "routing": list(routing),
    }
