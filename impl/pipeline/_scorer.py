"""What the teacher stage calls: a `Scorer` that adds a field to every row of a batch of groups.

The stage awaits `Scorer.score`. A real backend is a blocking function (a torch forward pass, a
remote call); `ThreadedScorer` runs it in a worker thread that is never abandoned, so a
cancelled run waits for the thread before it clears any row the teacher might still read.
A simulated scorer is a plain async function of virtual time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import trio

from groupflow.impl.core import SampleStore
from groupflow.model import GroupView


@attrs.frozen
class ScoreRequest:
    """One teacher call: the groups of a batch, the physical teacher, where the rows live."""

    teacher: str
    groups: tuple[GroupView, ...]
    store: SampleStore
    field: str
    """The field the call must write for every row of every group."""

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(sid for g in self.groups for sid in g.sample_ids)


@runtime_checkable
class Scorer(Protocol):
    """Writes `request.field` for every row of the request into `request.store`, or raises
    (writing nothing that stays: a failed call must leave no partial field)."""

    async def score(self, request: ScoreRequest) -> None: ...


@attrs.frozen
class ThreadedScorer:
    """Adapts a blocking scoring function to `Scorer`: it runs in a worker thread, and a
    cancelled caller still waits for the thread to return (trio's `to_thread.run_sync` without
    `abandon_on_cancel`)."""

    fn: Callable[[ScoreRequest], None]

    async def score(self, request: ScoreRequest) -> None:
        await trio.to_thread.run_sync(self.fn, request)
