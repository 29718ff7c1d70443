"""How much the lifecycle core costs: transitions per second through `ReplayBuffer`.

Each group goes reserve -> commit(defer_ready) -> take_for_scoring -> mark_ready -> select ->
release: five lifecycle transitions, each checked by `groupflow.model.fire`, plus the store
writes and clears. The same work runs over `MemoryStore`, over a store that keeps only ids (so
the figure is the buffer and the model alone), and with the full invariant check after every
step's groups. `fire` alone is timed too. Run: `python bench/buffer_transitions.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import trio

from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row
from groupflow.model import Actor, Event, GroupState, Guard, assert_invariants, fire

TRANSITIONS_PER_GROUP = 5
REQUIRED = frozenset({"input_ids", "teacher_reference_logprobs"})


class IdOnlyStore:
    """Keeps row ids and nothing else: the store's cost taken out of the measurement."""

    blocking = False

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def put(self, rows: Mapping[str, Any]) -> None:
        self._ids.update(rows)

    def add_fields(self, values: Mapping[str, Any]) -> None:
        pass

    def get(self, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        return {sid: {} for sid in sample_ids}

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        self._ids.difference_update(sample_ids)

    def list_ids(self) -> frozenset[str]:
        return frozenset(self._ids)

    def missing_fields(
        self, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[str]]:
        return {}


async def _drive(buffer: ReplayBuffer, groups: int, per_step: int, check: bool) -> None:
    size = buffer.config.group_size
    step = 0
    for start in range(0, groups, per_step):
        ids = [buffer.reserve(target_step=step, ordinal=start + i) for i in range(per_step)]
        for gid in ids:
            rows = [Row(f"{gid}-{j}", {"input_ids": j}) for j in range(size)]
            await buffer.commit(
                gid, rows, start_weight_version=step, end_weight_version=step, defer_ready=True
            )
        buffer.take_for_scoring(ids)
        for gid in ids:
            buffer.store.add_fields(
                {f"{gid}-{j}": {"teacher_reference_logprobs": j} for j in range(size)}
            )
            await buffer.mark_ready(gid, ["teacher_reference_logprobs"])
        if check:
            assert_invariants(buffer.snapshot())
        selection = buffer.select(step=step, weight_version=step)
        assert len(selection.groups) == per_step
        await buffer.release(selection.group_ids)
        step += 1


def _time_buffer(store: Any, groups: int, group_size: int, per_step: int, check: bool) -> float:
    config = BufferConfig(group_size=group_size, capacity=per_step, required_fields=REQUIRED)
    buffer = ReplayBuffer(config, store)
    t0 = time.perf_counter()
    trio.run(_drive, buffer, groups, per_step, check)
    elapsed = time.perf_counter() - t0
    assert len(buffer) == 0 and not store.list_ids()
    return groups * TRANSITIONS_PER_GROUP / elapsed


def _time_fire(n: int) -> float:
    path = [
        (None, Event.RESERVE, Actor.ROLLOUT, Guard.ALWAYS),
        (GroupState.RESERVED, Event.COMMIT, Actor.ROLLOUT, Guard.PENDING),
        (GroupState.WRITTEN, Event.TAKE_BATCH, Actor.STAGE, Guard.ALWAYS),
        (GroupState.SCORING, Event.SCORED, Actor.STAGE, Guard.COMPLETE),
        (GroupState.READY, Event.SELECT, Actor.TRAIN, Guard.ALWAYS),
    ]
    t0 = time.perf_counter()
    for _ in range(n // len(path)):
        for state, event, actor, guard in path:
            fire("g", state, event, actor=actor, guard=guard)
    return (n // len(path)) * len(path) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=40_000)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=8, help="groups per train step")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def best(fn: Any, *a: Any) -> float:
        return float(max(fn(*a) for _ in range(args.repeats)))

    g, size, per = args.groups, args.group_size, args.per_step
    figures = {
        "fire() alone": best(_time_fire, g * TRANSITIONS_PER_GROUP),
        "buffer + id-only store": best(lambda: _time_buffer(IdOnlyStore(), g, size, per, False)),
        "buffer + MemoryStore": best(lambda: _time_buffer(MemoryStore(), g, size, per, False)),
        "buffer + MemoryStore + invariants each step": best(
            lambda: _time_buffer(MemoryStore(), g, size, per, True)
        ),
    }
    if args.json:
        print(
            json.dumps(
                {"groups": g, "group_size": size, "per_step": per, "transitions_per_s": figures}
            )
        )
        return
    base = figures["buffer + MemoryStore"]
    print(
        f"{g} groups of {size} rows, {per} groups per step, {TRANSITIONS_PER_GROUP} transitions per group, best of {args.repeats}"
    )
    print(
        f"{'configuration':<45} {'transitions/s':>14} {'vs MemoryStore':>15} {'us/transition':>14}"
    )
    for name, rate in figures.items():
        print(f"{name:<45} {rate:>14,.0f} {rate / base:>14.2f}x {1e6 / rate:>14.2f}")


if __name__ == "__main__":
    main()
