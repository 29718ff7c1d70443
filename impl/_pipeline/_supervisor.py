"""`supervise`: the precedence between pumps, written once, on a trio nursery.

The controller hands over a list of pumps; adding a pump never edits this module. What a pump's
ending means depends only on its `PumpKind`:

- a MONITOR never returns; if it fails, its error is reported first, since it names the root
  cause (a stall, a dead fleet) of whatever else went wrong;
- a PRODUCER may return: once every producer has, the stages are told their upstream ended;
- a STAGE returns once its upstream ended and its backlog is empty; each stage hears that its
  upstream ended once every producer and every stage before it in the list has returned;
- the TERMINAL's return ends the run: producers are cancelled, stages drain, then monitors stop;
- any failure cancels everything else.

Shutdown after the terminal returns is bounded: stages that have not drained
`shutdown_timeout_s` later are cancelled (their own cleanup runs) and `ShutdownTimeout` is
raised. After a failure everything is cancelled at once; what is left to wait for is each pump's
shielded cleanup, one store or teacher call at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import trio

from groupflow.impl._pipeline._pump import Pump, PumpKind, StagePump
from groupflow.model.errors import ArgumentError, MonitorReturned, PumpFailed, ShutdownTimeout


@attrs.define
class _Running:
    pump: Pump
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: bool = False
    told: bool = False
    """A stage that has been told its upstream ended."""
    failure: Exception | None = None
    failure_order: int = 0


@attrs.define
class _Supervisor:
    pumps: list[_Running]
    shutdown_timeout_s: float
    nursery: trio.Nursery
    shutting_down: bool = False
    failures: int = 0
    deadline_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    timed_out: list[str] = attrs.field(factory=list)
    on_failure: Callable[[], None] | None = None
    """Told, before anything is cancelled, that the run fails."""

    def of_kind(self, kind: PumpKind) -> list[_Running]:
        return [r for r in self.pumps if r.pump.kind is kind]

    async def run_one(self, running: _Running) -> None:
        pump = running.pump
        try:
            with running.scope:
                await pump.run()
                if pump.kind is PumpKind.MONITOR:
                    raise MonitorReturned(
                        f"monitor {pump.name!r} returned; monitors loop until cancelled"
                    )
        except Exception as exc:
            running.failure = exc
            running.failure_order = self.failures
            self.failures += 1
            self.fail()
            return
        running.ended = True
        if pump.kind is PumpKind.MONITOR:
            return  # stopped by us at the end of the run
        if pump.kind is PumpKind.TERMINAL:
            self.begin_shutdown()
        self.tell_stages()  # a producer cancelled at shutdown has really returned only now
        if self.shutting_down:
            self.finish_when_drained()

    def tell_stages(self) -> None:
        """Tell each stage whose upstream (every producer, every earlier stage) has returned."""
        upstream_done = all(r.ended for r in self.of_kind(PumpKind.PRODUCER))
        for running in self.of_kind(PumpKind.STAGE):
            if not upstream_done:
                return
            if not running.ended and not running.told:
                running.told = True
                stage = running.pump
                assert isinstance(stage, StagePump)
                stage.upstream_ended()
            upstream_done = running.ended

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        for running in self.of_kind(PumpKind.PRODUCER):
            running.scope.cancel()
        self.nursery.start_soon(self.enforce_deadline, name="shutdown deadline")

    def finish_when_drained(self) -> None:
        if all(r.ended for r in self.of_kind(PumpKind.STAGE)):
            for running in self.of_kind(PumpKind.MONITOR):
                running.scope.cancel()
            self.deadline_scope.cancel()

    async def enforce_deadline(self) -> None:
        with self.deadline_scope:
            await trio.sleep(self.shutdown_timeout_s)
            self.timed_out = [r.pump.name for r in self.of_kind(PumpKind.STAGE) if not r.ended]
            self.fail()

    def fail(self) -> None:
        if self.on_failure is not None:
            self.on_failure()
        self.cancel_all()

    def cancel_all(self) -> None:
        for running in self.pumps:
            running.scope.cancel()
        self.deadline_scope.cancel()


def _check(pumps: Sequence[Pump]) -> None:
    names = [p.name for p in pumps]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ArgumentError(f"pump names must be unique; repeated: {repeated}")
    terminals = [p.name for p in pumps if p.kind is PumpKind.TERMINAL]
    if len(terminals) != 1:
        raise ArgumentError(f"a run needs exactly one TERMINAL pump, got {terminals or 'none'}")
    deaf = [p.name for p in pumps if p.kind is PumpKind.STAGE and not isinstance(p, StagePump)]
    if deaf:
        raise TypeError(f"STAGE pumps need an upstream_ended() method: {deaf}")


async def supervise(
    pumps: Sequence[Pump],
    *,
    shutdown_timeout_s: float,
    on_failure: Callable[[], None] | None = None,
) -> None:
    """Run `pumps` until the terminal returns and the stages have drained. `on_failure` is
    called once a pump fails (or shutdown overruns), before the others are cancelled.

    Raises `PumpFailed` for the first failure (a monitor's before any other) and
    `ShutdownTimeout` when stages do not drain in time.
    """
    _check(pumps)
    async with trio.open_nursery() as nursery:
        sup = _Supervisor(
            [_Running(p) for p in pumps], shutdown_timeout_s, nursery, on_failure=on_failure
        )
        for running in sup.pumps:
            nursery.start_soon(sup.run_one, running, name=f"pump {running.pump.name}")
    failed = sorted(
        (r for r in sup.pumps if r.failure is not None),
        key=lambda r: (r.pump.kind is not PumpKind.MONITOR, r.failure_order),
    )
    if failed:
        root = failed[0]
        error = PumpFailed(
            f"{root.pump.kind} {root.pump.name!r} failed: {root.failure!r}",
            pump=root.pump.name,
            kind=root.pump.kind,
        )
        for other in failed[1:]:
            error.add_note(f"also failed: {other.pump.kind} {other.pump.name!r}: {other.failure!r}")
        raise error from root.failure
    if sup.timed_out:
        raise ShutdownTimeout(
            f"stages {sup.timed_out} had not drained {shutdown_timeout_s} s after the run ended; "
            f"they were cancelled"
        )
