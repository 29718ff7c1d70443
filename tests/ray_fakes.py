"""Teachers for Ray actors in the tests: constant log-probs, and ways to die or hang on cue.

Import it only after Ray is known to be installed. The module registers itself with Ray's
pickler to travel by value: the actors need not (and, with TransferQueue's own top-level
`tests` package installed, could not reliably) import it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import attrs
import ray.cloudpickle

from groupflow.impl.contract import TokenRow

register: Callable[[ModuleType], None] = ray.cloudpickle.register_pickle_by_value
register(sys.modules[__name__])

CRASH = 251
"""A row whose first token is this makes the actor scoring it exit (a dead process)."""
HANG = 252
"""A row whose first token is this makes the actor scoring it sleep for an hour."""
RAISE = 253
"""A row whose first token is this makes the teacher raise `ValueError` (the actor lives)."""


@attrs.frozen
class ConstantTeacher:
    """Every response token gets log-prob `value`; a row that starts with `CRASH`, `HANG` or
    `RAISE` kills the actor, freezes it, or raises; `delay_s` makes every call slow."""

    value: float = -1.0
    delay_s: float = 0.0
    dp_size: int = 1

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        rows = [row for shard in shards for row in shard]
        if any(row.input_ids[0] == CRASH for row in rows):
            os._exit(1)
        if any(row.input_ids[0] == RAISE for row in rows):
            raise ValueError("the teacher was told to raise")
        if any(row.input_ids[0] == HANG for row in rows):
            time.sleep(3600)
        time.sleep(self.delay_s)
        return [[[self.value] * row.response_length for row in shard] for shard in shards]


def failing_teacher() -> ConstantTeacher:
    """A factory that fails: the actor never starts."""
    raise ValueError("no such checkpoint: /nowhere/teacher.pt")


def row(first: int, length: int = 6, prompt: int = 2) -> TokenRow:
    """A row whose first token is `first` (`CRASH`, `HANG`, or anything else)."""
    return TokenRow((first, *range(1, length)), prompt)


def join_write_close(partition: str, sample_id: str) -> dict[str, bool]:
    """In a Ray worker: join the running TransferQueue, write one row, close the store."""
    from groupflow.impl._core._tq_store import TransferQueueStore

    store = TransferQueueStore.open(partition=partition, timeout_s=30)
    try:
        store.put({sample_id: {"ids": [7, 8]}})
    finally:
        store.close()
    return {"owner": store.owner}
