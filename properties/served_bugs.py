"""Seeded bugs in the served engines and what the pipeline does around them: small, named
changes of behaviour the served machine (`served_machine`) must catch, each with the words its
failure says. `pipeline_bugs.applied(name, BUGS)` patches one in for a block;
`tests/properties/test_served_machine.py` asserts the machine catches every one at the CI budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from groupflow.impl import ReplayBuffer
from groupflow.impl._pipeline import Pipeline, TrainPosition
from groupflow.impl.engines import ServedGenerator
from groupflow.impl.engines import _completions as completions
from groupflow.impl.engines import _served_teachers as served_teachers
from groupflow.impl.errors import EngineOutputError
from groupflow.properties.pipeline_bugs import Patches, SeededBug

__all__ = ["BUGS"]


def _labelled_by_the_request(patch: Patches) -> None:
    """Rows carry the version the pipeline asked for, not the one the server holds: a rollout
    asked for during a sync is sampled after the reload, labelled before it."""
    patch.setattr(ServedGenerator, "_label", lambda self, request: request.weight_version)


def _sync_does_not_wait_for_answers(patch: Patches) -> None:
    """The sync pauses at once under `wait`: a request on its way in meets the paused server,
    waits out the reload and is sampled by the new weights, labelled with the old."""

    async def at_once(self: ServedGenerator) -> None:
        return None

    patch.setattr(ServedGenerator, "_answered", at_once)


def _end_version_blind_to_a_sync(patch: Patches) -> None:
    """A group that ends while a sync runs gets the old version as its end: under
    `interrupt` its rows may hold tokens of the new weights its labels do not name."""
    patch.setattr(TrainPosition, "newest_weights", property(lambda self: self.weight_version))


def _ready_rows_kept_at_exit(patch: Patches) -> None:
    """The run's exit leaves READY groups (a step ahead, a failed run's) with their rows."""

    async def exit_only(self: Pipeline) -> None:
        self.status.exit()

    patch.setattr(Pipeline, "_exit", exit_only)


def _finite_is_enough(patch: Patches) -> None:
    """A log-prob only has to be a finite number: vLLM's -9999.0 for minus infinity, and a
    positive one, are trained on."""

    def finite(value: object, *, where: str, what: str) -> float:
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise EngineOutputError(f"{where}: no log-prob for {what}")
        return float(value)

    patch.setattr(completions, "check_logprob", finite)


def _replica_shards_strided(patch: Patches) -> None:
    """Rows dealt to a teacher's replicas in turn, answers joined in order: rows get each
    other's log-probs."""

    def strided(rows: list[Any], parts: int) -> list[list[Any]]:
        return [rows[i::parts] for i in range(parts)]

    patch.setattr(served_teachers, "_split", strided)


def _groups_let_go_one_by_one(patch: Patches) -> None:
    """A step's groups leave the buffer one store call at a time: with a remote store, the
    rollout pump admits a prompt into the room the first one left while the step still
    holds the others (the model frees the room at once, when the step ends)."""
    original = ReplayBuffer._let_go

    async def one_by_one(self: ReplayBuffer, slots: Sequence[Any]) -> None:
        for slot in slots:
            await original(self, [slot])

    patch.setattr(ReplayBuffer, "_let_go", one_by_one)


BUGS: dict[str, SeededBug] = {
    "rows labelled by the request": SeededBug(_labelled_by_the_request, "labelled"),
    "sync does not wait for answers": SeededBug(_sync_does_not_wait_for_answers, "labelled"),
    "end version blind to a sync": SeededBug(_end_version_blind_to_a_sync, "outside its group"),
    "READY rows kept at exit": SeededBug(
        _ready_rows_kept_at_exit, "rows left in the store|live state differs"
    ),
    "a finite log-prob is enough": SeededBug(_finite_is_enough, "impossible log-prob"),
    "replica shards strided": SeededBug(_replica_shards_strided, "are not the teacher's"),
    "groups let go one by one": SeededBug(_groups_let_go_one_by_one, "does not allow .* admit"),
}
