"""Seeded bugs in the bridge between trio and asyncio (`groupflow.impl.aio`): small, named
changes of behaviour the pipeline machine's asyncio variant must catch, each with the words its
failure says. `pipeline_bugs.applied(name, BUGS)` patches one in for a block;
`tests/properties/test_pipeline_machine.py` asserts the machine catches both at the CI budget (the third,
a host that returns before the run drained, is `aio.run`'s, caught in `tests/aio/test_aio.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from groupflow.impl.aio import _part
from groupflow.properties.pipeline_bugs import Patches, SeededBug

__all__ = ["BUGS"]


def _task_not_cancelled(patch: Patches) -> None:
    """A trio cancel (a crash, a call past its limit) leaves the part's asyncio task running:
    the trio side waits for a task nobody told to stop."""
    patch.setattr(_part, "_cancel_task", lambda task: None)


def _exception_lost(patch: Patches) -> None:
    """A part's error does not cross: the call returns None in its place."""

    def swallowed(what: str, task: asyncio.Task[Any]) -> Any:
        if task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    patch.setattr(_part, "_outcome", swallowed)


BUGS: dict[str, SeededBug] = {
    "the asyncio task is not cancelled on a trio cancel": SeededBug(
        _task_not_cancelled, "did not end when cancelled|did not settle"
    ),
    "a part's exception is lost on the way across": SeededBug(
        _exception_lost, "error the machine did not cause|written wrong|lacks"
    ),
}
