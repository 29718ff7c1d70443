"""What the teacher stage calls: a `Scorer` that adds a field to every row of a batch of groups.

The stage awaits `Scorer.score`. A real backend is a blocking function (a torch forward pass, a
remote call); `ThreadedScorer` runs it in a worker thread that a cancelled run waits for
before it clears any row the teacher might still read, and abandons only when the thread
ignores the cancel for `abandon_after_s` (`ScorerLost`). `call_scorer` bounds every call.
A simulated scorer is a plain async function of virtual time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Mapping

import attrs
import trio

from groupflow.impl.contract import Scorer, ScoreRequest
from groupflow.model.errors import ScorerLost, ScoringTimeout


def teachers_of(scorer: object) -> frozenset[str] | None:
    """The physical teachers `scorer` says it serves; None when it does not say."""
    teachers = getattr(scorer, "teachers", None)
    if teachers is None:
        return None
    if isinstance(teachers, Mapping):
        return frozenset(teachers)
    if isinstance(teachers, Collection) and not isinstance(teachers, str):
        return frozenset(teachers)
    return None


def reads_of(scorer: object) -> frozenset[str]:
    """The row fields `scorer` says it reads (none when it does not say)."""
    reads = getattr(scorer, "reads", None)
    if isinstance(reads, Collection) and not isinstance(reads, str):
        return frozenset(reads)
    return frozenset()


async def call_scorer(scorer: Scorer, request: ScoreRequest, *, timeout_s: float) -> None:
    """`scorer.score(request)`, bounded: a call past `timeout_s` is cancelled and raises
    `ScoringTimeout` (a `ThreadedScorer` first waits for its thread, see there)."""
    with trio.move_on_after(timeout_s) as limit:
        await scorer.score(request)
    if limit.cancelled_caught:
        raise ScoringTimeout(
            f"teacher {request.teacher!r} did not return within call_timeout_s={timeout_s:g} "
            f"(groups {[g.group_id for g in request.groups]})"
        )


@attrs.frozen
class ThreadedScorer:
    """Adapts a blocking scoring function to `Scorer`: it runs in a worker thread. A cancelled
    caller waits for the thread to return (so no row it reads is cleared under it), at most
    `request.abandon_after_s`; a thread still running then is abandoned and `ScorerLost` is
    raised, naming the teacher and the rows it may still touch: a teacher that ignores
    cancellation cannot keep the run, or the process, alive."""

    fn: Callable[[ScoreRequest], None]

    @property
    def teachers(self) -> frozenset[str] | None:
        """Those of the function, when it says (`TeacherScorer` does)."""
        return teachers_of(self.fn)

    @property
    def reads(self) -> frozenset[str]:
        return reads_of(self.fn)

    async def score(self, request: ScoreRequest) -> None:
        token = trio.lowlevel.current_trio_token()
        returned = trio.Event()
        failure: list[BaseException] = []
        lock = threading.Lock()
        # whether the thread began the call, and whether the caller gave up before it did (then
        # it never will): decided under the lock, so the two cannot both happen
        began, gave_up = [False], [False]

        def work() -> None:
            with lock:
                if gave_up[0]:
                    return  # cancelled before the thread got here: the call never happens
                began[0] = True
            try:
                self.fn(request)
            except BaseException as exc:
                failure.append(exc)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(returned.set)

        try:
            await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except trio.Cancelled:
            with lock:
                if not began[0]:
                    # cancelled before the thread began (waiting for a thread, say): nothing
                    # reads the rows, so there is nothing to wait for
                    gave_up[0] = True
                    raise
            # a shutdown, a crash, the call limit: the thread may still be reading rows, so
            # wait for it, bounded. Like a thread that is never abandoned, a call that returns
            # meanwhile returns; cancellation is level-triggered in trio, so the caller's
            # next checkpoint still raises it.
            with trio.CancelScope(shield=True), trio.move_on_after(request.abandon_after_s):
                await returned.wait()
            if not returned.is_set():
                raise ScorerLost(
                    f"teacher {request.teacher!r} ignored cancellation: its call had not returned "
                    f"{request.abandon_after_s:g} s after it was cancelled, so its worker thread "
                    f"is abandoned; it may still read or write rows {list(request.sample_ids)} "
                    f"and leave padding rows in the store"
                ) from None
        if failure:
            raise failure[0]
