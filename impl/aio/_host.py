"""A trio run hosted on the running asyncio loop, in trio's guest mode: trio's own way to live
inside another loop, on its thread, without trio-asyncio.

The loop runs trio's ticks as callbacks (`call_soon_threadsafe`); trio waits for I/O in a
worker thread of its own. So trio code and asyncio code take turns on one thread: neither
blocks the other while it awaits, and a part's asyncio task and the trio task awaiting it
(`groupflow.impl.aio.part`) hand results across without locks.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import outcome
import trio

from groupflow.model.errors import CallOrderError, WrongLoop

log = logging.getLogger("groupflow.aio")

T = TypeVar("T")

DEFAULT_ABANDON_S = 60.0
"""How long a cancelled asyncio part's task may take to end before it is abandoned, when the
run hosting it says nothing (`aio.run` passes the pipeline's `shutdown_timeout_s`)."""


@attrs.define
class GuestRun:
    """One trio run in guest mode on `loop`: what the bridged parts and the host share."""

    loop: asyncio.AbstractEventLoop
    abandon_after_s: float
    done: asyncio.Future[outcome.Outcome[Any]]
    context: contextvars.Context
    """The asyncio side's context, where it started the run: the parts' tasks run in copies."""
    token: trio.lowlevel.TrioToken | None = None
    scope: trio.CancelScope | None = None
    cancel_asked: bool = False
    calls: int = 0
    """Calls of asyncio parts in flight: their task started and trio has not yet taken its
    result (the pipeline machine waits until every one is held by the machine or ended)."""

    def cancel(self) -> None:
        """Cancel the trio run (from the loop's thread, outside trio): it drains and ends."""
        self.cancel_asked = True
        if self.token is None or self.scope is None:
            return  # not begun: `_guest` cancels as it begins
        try:
            self.token.run_sync_soon(self.scope.cancel)
        except trio.RunFinishedError:
            pass


_RUN: trio.lowlevel.RunVar[GuestRun] = trio.lowlevel.RunVar("groupflow_aio_guest_run")


def current_guest_run() -> GuestRun | None:
    """The guest run this trio code runs in, when an `aio` host started it."""
    try:
        return _RUN.get()
    except (LookupError, RuntimeError):
        return None


def start_guest(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    loop: asyncio.AbstractEventLoop,
    abandon_after_s: float = DEFAULT_ABANDON_S,
    clock: trio.abc.Clock | None = None,
    schedule: Callable[[Callable[[], object]], object] | None = None,
) -> GuestRun:
    """Start `fn(*args)` as a trio run on `loop` (from the loop's thread); its outcome lands in
    the returned run's `done` future. One trio run per thread, as trio allows. `schedule`
    replaces `loop.call_soon_threadsafe` for trio's ticks (the pipeline machine queues them,
    to run each at a moment of its choosing)."""
    if trio.lowlevel.in_trio_run():
        raise CallOrderError(
            "a trio run is already going on this thread (groupflow hosts one run per loop): "
            "await its pipelines from inside it, or run one after the other"
        )
    run = GuestRun(loop, abandon_after_s, loop.create_future(), contextvars.copy_context())

    async def _guest() -> T | None:
        run.token = trio.lowlevel.current_trio_token()
        _RUN.set(run)
        with trio.CancelScope() as scope:
            run.scope = scope
            if run.cancel_asked:
                scope.cancel()
            return await fn(*args)
        return None  # cancelled from asyncio: the host raises CancelledError

    def _finished(result: outcome.Outcome[Any]) -> None:
        if not run.done.done():
            run.done.set_result(result)

    trio.lowlevel.start_guest_run(
        _guest,
        run_sync_soon_threadsafe=schedule or loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=schedule or loop.call_soon,
        done_callback=_finished,
        host_uses_signal_set_wakeup_fd=True,
        clock=clock,
    )
    return run


async def host(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    drain_s: float,
    abandon_after_s: float = DEFAULT_ABANDON_S,
) -> T:
    """`await fn(*args)` as trio code, from asyncio code: hosted on the running loop, the
    trio function's result or error coming back as its own. Cancelling the awaiting task
    cancels the trio run, waits for it to end (at most `drain_s`: after that the run is left
    to finish on the loop, logged), and then raises `CancelledError`."""
    if trio.lowlevel.in_trio_task():
        raise WrongLoop(
            "groupflow.impl.aio hosts a run from asyncio code, and this is trio code: await "
            "the pipeline's run() here directly"
        )
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise WrongLoop(
            "groupflow.impl.aio.run() needs a running asyncio loop: call it as "
            "asyncio.run(groupflow.impl.aio.run(pipeline))"
        ) from None
    run = start_guest(fn, *args, loop=loop, abandon_after_s=abandon_after_s)
    try:
        ended = await asyncio.shield(run.done)
    except asyncio.CancelledError:
        run.cancel()
        await _drain(run, drain_s)
        raise
    value: T = ended.unwrap()
    return value


async def _drain(run: GuestRun, bound_s: float) -> None:
    """Wait for a cancelled run to end, at most `bound_s`, whatever cancels come meanwhile
    (a second Ctrl-C of `asyncio.run` cancels again). Its error, if it ended with one other
    than the cancel, is logged: the caller sees the `CancelledError` it asked for."""
    deadline = run.loop.time() + bound_s
    while not run.done.done():
        left = deadline - run.loop.time()
        if left <= 0:
            log.warning(
                "the groupflow run did not end within %g s after it was cancelled; it goes on "
                "ending on the loop",
                bound_s,
            )
            return
        try:
            await asyncio.wait([run.done], timeout=left)
        except asyncio.CancelledError:
            continue
    ended = run.done.result()
    if isinstance(ended, outcome.Error) and not isinstance(ended.error, trio.Cancelled):
        log.warning("the cancelled groupflow run ended with %r", ended.error)
