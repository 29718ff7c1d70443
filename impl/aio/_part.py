"""Parts written for asyncio (a generator, a learner, a scorer), run on the host loop: each call
of one of their `async def` methods is an asyncio task there, awaited from the trio task that
made it.

`part(obj)` wraps the object; every other attribute (`fields`, `teachers`, `reads`,
`dp_size`, `cancel_grace_s`, a plain `state_dict`) is the object's own, so `build_pipeline`
checks an asyncio part exactly as it checks any other. A trio cancel cancels the task and
waits for it to end, as a worker thread is waited for; a task that ignores its cancel is
abandoned after a bound, with a named error.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import trio

from groupflow.impl._pipeline import part_name
from groupflow.impl.aio._host import DEFAULT_ABANDON_S, GuestRun, current_guest_run
from groupflow.impl.contract import ScoreRequest
from groupflow.model.errors import ArgumentError, PartLost, ScorerLost, WrongLoop

log = logging.getLogger("groupflow.aio")


class AsyncioPart:
    """A user's part whose `async def` methods are asyncio coroutines (`part(obj)` makes one).

    Reading an attribute reads the part's; an `async def` method comes back as a trio
    coroutine function that runs the call as a task on the host loop. Setting an attribute
    sets the part's."""

    groupflow_host: ClassVar[str] = "asyncio"
    """What `Pipeline.run` looks for: this part needs an asyncio loop under the trio run."""

    __slots__ = ("__wrapped__",)
    __wrapped__: Any

    def __init__(self, obj: object) -> None:
        object.__setattr__(self, "__wrapped__", obj)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__wrapped__, name)
        if inspect.iscoroutinefunction(value):
            return _bridge(self, name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__wrapped__, name, value)

    def __repr__(self) -> str:
        return f"groupflow.impl.aio.part({self.__wrapped__!r})"


def part(obj: object) -> Any:
    """Declare `obj` an asyncio part: its `async def` methods run on the asyncio loop hosting
    the run (`groupflow.impl.aio.run`), each call as a task of their own. Pass the result
    to `build_pipeline` where the object would go (a generator, a learner, a scorer; a
    learner's `state_dict` and `load_state_dict` may be `async def` too)."""
    if isinstance(obj, AsyncioPart):
        return obj
    if isinstance(obj, type):
        raise ArgumentError(
            f"groupflow.impl.aio.part({obj.__name__}) got a class: pass an instance, "
            f"aio.part({obj.__name__}(...))"
        )
    methods = [
        name
        for name in dir(obj)
        if not name.startswith("__") and inspect.iscoroutinefunction(getattr(obj, name, None))
    ]
    if not methods:
        raise ArgumentError(
            f"groupflow.impl.aio.part({part_name(obj)}): it has no `async def` method to run on "
            f"asyncio; pass it to build_pipeline as it is"
        )
    return AsyncioPart(obj)


def _bridge(
    owner: AsyncioPart, name: str, method: Callable[..., Coroutine[Any, Any, Any]]
) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        request = args[0] if args and isinstance(args[0], ScoreRequest) else None
        return await _Call(owner, name, request).run(method(*args, **kwargs))

    call.__name__ = name
    call.__qualname__ = f"{part_name(owner)}.{name}"
    return call


async def call_serving(owner: AsyncioPart, name: str, request: ScoreRequest, *args: Any) -> Any:
    """`owner.name(*args)` as a call serving the stage's `request` (a teacher's
    `score_shards`): abandoned after the request's bound, as `ScorerLost`."""
    method = getattr(owner.__wrapped__, name)
    return await _Call(owner, name, request).run(method(*args))


class _Call:
    """One call of an asyncio part, from the trio task awaiting it."""

    def __init__(self, owner: AsyncioPart, name: str, request: ScoreRequest | None) -> None:
        self.what = f"{part_name(owner)}.{name}()"
        self.request = request
        """The stage's request the call serves, when it serves one: its bound and its
        teacher name the call's abandonment."""
        self.guest = current_guest_run()
        self.abandoned = False
        self.taken = False

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            raise WrongLoop(
                f"{self.what} is an asyncio part's call, awaited in a trio run with no asyncio "
                f"loop: run the pipeline with asyncio.run(groupflow.impl.aio.run(pipeline))"
            ) from None
        token = trio.lowlevel.current_trio_token()
        ended = trio.Event()

        def on_done(task: asyncio.Task[Any]) -> None:
            if self.abandoned:  # nobody waits for it now: its end is logged, not lost
                _report_abandoned(self.what, task)
                return
            if self.taken:  # trio saw it end while it spun, and took its outcome
                return
            try:
                token.run_sync_soon(ended.set)
            except trio.RunFinishedError:
                _report_abandoned(self.what, task)

        # the asyncio side's context (not the trio task's: sniffio and friends would say
        # "trio" there), so asyncio code in the part sees its own loop's world
        context = self.guest.context.copy() if self.guest else contextvars.Context()
        task = loop.create_task(coro, name=f"groupflow {self.what}", context=context)
        task.add_done_callback(on_done)
        guest: GuestRun | None = self.guest
        if guest is not None:
            guest.calls += 1
        try:
            try:
                await _until_done(task, ended)
                self.taken = True
            except trio.Cancelled:
                _cancel_task(task)
                with trio.CancelScope(shield=True), trio.move_on_after(self._abandon_after_s()):
                    await ended.wait()
                if not ended.is_set():
                    self.abandoned = True
                    raise self._lost() from None
                if task.cancelled():
                    raise
                # it ended with a result or an error all the same: that is what it did (the
                # cancel stays pending in trio and is raised at the caller's next checkpoint)
        finally:
            if guest is not None:
                guest.calls -= 1
        return _outcome(self.what, task)

    def _abandon_after_s(self) -> float:
        if self.request is not None:
            return self.request.abandon_after_s
        return self.guest.abandon_after_s if self.guest is not None else DEFAULT_ABANDON_S

    def _lost(self) -> Exception:
        bound = self._abandon_after_s()
        if self.request is not None:
            return ScorerLost(
                f"teacher {self.request.teacher!r} ({self.what} on asyncio) ignored cancellation: "
                f"its task had not ended {bound:g} s after it was cancelled, so it is abandoned "
                f"on the loop; it may still read or write rows {list(self.request.sample_ids)}"
            )
        return PartLost(
            f"{self.what} ignored cancellation: its asyncio task had not ended {bound:g} s after "
            f"it was cancelled, so it is abandoned on the loop (make it let asyncio's "
            f"CancelledError through)"
        )


SPINS = 2
"""Trio ticks a call waits, letting the loop run its task, before trio parks on its event: a
call that ends at once (no real I/O) is then taken without the wake-up through trio's I/O
thread that parking costs (about 100 us on two cores)."""


async def _until_done(task: asyncio.Task[Any], ended: trio.Event) -> None:
    for _ in range(SPINS):
        if task.done():
            return
        # the next trio tick is queued behind the task's step on the loop
        await trio.lowlevel.checkpoint()
    await ended.wait()


def _cancel_task(task: asyncio.Task[Any]) -> None:
    task.cancel()


def _outcome(what: str, task: asyncio.Task[Any]) -> Any:
    """What the task did, as the part did it: its result, or its own exception."""
    if task.cancelled():
        raise PartLost(
            f"{what} was cancelled by something other than groupflow (asyncio code cancelling "
            f"its task, or the loop closing)"
        )
    error = task.exception()
    if error is not None:
        raise error
    return task.result()


def _report_abandoned(what: str, task: asyncio.Task[Any]) -> None:
    """An abandoned call ended (or the run ended before it): say how, so that its error is
    not lost (and asyncio does not warn that nobody retrieved it)."""
    if task.cancelled():
        log.warning("the abandoned call %s ended, cancelled", what)
        return
    error = task.exception()
    if error is not None:
        log.warning("the abandoned call %s ended with %r", what, error)
    else:
        log.warning("the abandoned call %s ended", what)
