"""`supervise`: what each kind of pump's ending means, under virtual time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl._pipeline import Pump, PumpKind, StagePump, single_error, supervise
from groupflow.impl.errors import MonitorReturned, PumpFailed, ShutdownTimeout

Body = Callable[["FakePump"], Awaitable[None]]


@attrs.define
class FakePump:
    name: str
    kind: PumpKind
    body: Body
    log: list[str]

    async def run(self) -> None:
        self.log.append(f"{self.name} start")
        try:
            await self.body(self)
        except trio.Cancelled:
            self.log.append(f"{self.name} cancelled")
            raise
        self.log.append(f"{self.name} end")


@attrs.define
class FakeStage(FakePump):
    """Drains by waiting on `drained`: the test decides how long its backlog takes."""

    told: trio.Event = attrs.field(factory=trio.Event)
    drain_s: float = 1.0

    def upstream_ended(self) -> None:
        self.log.append(f"{self.name} told")
        self.told.set()


async def forever(p: FakePump) -> None:
    await trio.sleep_forever()


def after(seconds: float) -> Body:
    async def body(p: FakePump) -> None:
        await trio.sleep(seconds)

    return body


def fails_after(seconds: float, error: Exception) -> Body:
    async def body(p: FakePump) -> None:
        await trio.sleep(seconds)
        raise error

    return body


async def fails_on_cancel(p: FakePump) -> None:
    """Fails as it is cancelled: a second failure, after the one that cancelled it."""
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        raise RuntimeError(f"{p.name} could not stop") from None


async def drains(p: FakePump) -> None:
    assert isinstance(p, FakeStage)
    await p.told.wait()
    await trio.sleep(p.drain_s)


@pytest.fixture
def log() -> list[str]:
    return []


def pump(log: list[str], name: str, kind: PumpKind, body: Body) -> FakePump:
    return FakePump(name, kind, body, log)


def stage(log: list[str], name: str, drain_s: float = 1.0) -> FakeStage:
    return FakeStage(name, PumpKind.STAGE, drains, log, drain_s=drain_s)


async def run(pumps: list[Pump], timeout: float = 30.0) -> float:
    """Supervise under the test's MockClock; returns the virtual seconds it took."""
    start = trio.current_time()
    with trio.fail_after(1000):
        await supervise(pumps, shutdown_timeout_s=timeout)
    return trio.current_time() - start


async def test_producer_end_drains_stages_then_terminal_ends_run(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, forever),
        pump(log, "rollout", PumpKind.PRODUCER, after(5)),
        stage(log, "teacher", drain_s=2),
        pump(log, "train", PumpKind.TERMINAL, after(10)),
    ]
    assert await run(pumps) == 10
    assert log.index("rollout end") < log.index("teacher told") < log.index("teacher end")
    assert log.index("teacher end") < log.index("train end") < log.index("watchdog cancelled")


async def test_terminal_return_cancels_producer_and_drains_stages_before_monitors_stop(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, forever),
        pump(log, "rollout", PumpKind.PRODUCER, forever),
        stage(log, "teacher", drain_s=3),
        pump(log, "train", PumpKind.TERMINAL, after(4)),
    ]
    assert await run(pumps) == 7
    assert "rollout cancelled" in log
    assert log.index("train end") < log.index("teacher told") < log.index("teacher end")
    assert log.index("teacher end") < log.index("watchdog cancelled")


async def test_stages_hear_in_order(log: list[str], autojump_clock: trio.testing.MockClock) -> None:
    """A stage's upstream is every producer and every stage before it."""
    pumps: list[Pump] = [
        pump(log, "rollout", PumpKind.PRODUCER, after(1)),
        pump(log, "sft", PumpKind.PRODUCER, after(2)),
        stage(log, "teacher", drain_s=5),
        stage(log, "reward", drain_s=1),
        pump(log, "train", PumpKind.TERMINAL, after(20)),
    ]
    await run(pumps)
    assert log.index("sft end") < log.index("teacher told")
    assert log.index("teacher end") < log.index("reward told")


async def test_monitor_failure_is_reported_first(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    """The terminal fails first, but the monitor's error names the root cause."""

    async def watchdog(p: FakePump) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise TimeoutError("no progress for 600 s") from None

    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, watchdog),
        pump(log, "train", PumpKind.TERMINAL, fails_after(3, KeyError("step 4"))),
    ]
    with pytest.raises(PumpFailed) as caught:
        await run(pumps)
    assert (caught.value.pump, caught.value.kind) == ("watchdog", PumpKind.MONITOR)
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert any("train" in note for note in caught.value.__notes__)


async def test_monitor_failing_while_terminal_runs_cancels_the_run(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, fails_after(2, RuntimeError("stalled"))),
        pump(log, "rollout", PumpKind.PRODUCER, forever),
        stage(log, "teacher"),
        pump(log, "train", PumpKind.TERMINAL, forever),
    ]
    with pytest.raises(PumpFailed, match="watchdog") as caught:
        await run(pumps)
    assert caught.value.kind is PumpKind.MONITOR
    assert {"rollout cancelled", "teacher cancelled", "train cancelled"} <= set(log)
    assert trio.current_time() == 2


async def test_monitor_that_returns_is_a_failure(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [
        pump(log, "probe", PumpKind.MONITOR, after(1)),
        pump(log, "train", PumpKind.TERMINAL, forever),
    ]
    with pytest.raises(PumpFailed) as caught:
        await run(pumps)
    assert isinstance(caught.value.__cause__, MonitorReturned)


@pytest.mark.parametrize("kind", [PumpKind.PRODUCER, PumpKind.STAGE, PumpKind.TERMINAL])
async def test_any_failure_cancels_the_rest(
    kind: PumpKind, log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    failing = fails_after(1, ValueError("boom"))
    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, forever),
        pump(log, "rollout", PumpKind.PRODUCER, failing if kind is PumpKind.PRODUCER else forever),
        FakeStage("teacher", PumpKind.STAGE, failing if kind is PumpKind.STAGE else drains, log),
        pump(log, "train", PumpKind.TERMINAL, failing if kind is PumpKind.TERMINAL else forever),
    ]
    with pytest.raises(PumpFailed) as caught:
        await run(pumps)
    assert caught.value.kind is kind
    assert isinstance(caught.value.__cause__, ValueError)
    assert trio.current_time() == 1
    assert "watchdog cancelled" in log


async def test_shutdown_is_bounded(log: list[str], autojump_clock: trio.testing.MockClock) -> None:
    pumps: list[Pump] = [
        pump(log, "watchdog", PumpKind.MONITOR, forever),
        stage(log, "teacher", drain_s=1000),
        pump(log, "train", PumpKind.TERMINAL, after(1)),
    ]
    with pytest.raises(ShutdownTimeout, match="teacher"):
        await run(pumps, timeout=30)
    assert trio.current_time() == 31
    assert "teacher cancelled" in log and "watchdog cancelled" in log


async def test_no_deadline_wait_after_a_clean_shutdown(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [pump(log, "train", PumpKind.TERMINAL, after(2))]
    assert await run(pumps, timeout=500) == 2


def test_pump_lists_are_checked(log: list[str]) -> None:
    train = pump(log, "train", PumpKind.TERMINAL, forever)
    with pytest.raises(ValueError, match="exactly one TERMINAL"):
        trio.run(
            lambda: supervise(
                [pump(log, "rollout", PumpKind.PRODUCER, forever)], shutdown_timeout_s=1.0
            )
        )
    with pytest.raises(ValueError, match="unique.*'train'"):
        trio.run(lambda: supervise([train, train], shutdown_timeout_s=1.0))
    deaf = pump(log, "teacher", PumpKind.STAGE, forever)
    with pytest.raises(TypeError, match="upstream_ended"):
        trio.run(lambda: supervise([deaf, train], shutdown_timeout_s=1.0))


def test_fakes_satisfy_the_protocols(log: list[str]) -> None:
    assert isinstance(pump(log, "x", PumpKind.PRODUCER, forever), Pump)
    assert isinstance(stage(log, "y"), StagePump)


async def test_the_first_failure_is_the_root_whatever_the_order_of_the_list(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    """Of two non-monitor failures, the one that happened first is raised, the other a note,
    though the other is listed first; the root is not repeated as a note."""
    pumps: list[Pump] = [
        pump(log, "rollout", PumpKind.PRODUCER, fails_on_cancel),
        pump(log, "train", PumpKind.TERMINAL, fails_after(1, KeyError("step 4"))),
    ]
    with pytest.raises(PumpFailed) as caught:
        await run(pumps)
    assert caught.value.pump == "train"
    notes = caught.value.__notes__
    assert len(notes) == 1 and "rollout" in notes[0] and "train" not in notes[0], notes


async def test_three_failures_name_the_other_two_in_notes(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    pumps: list[Pump] = [
        pump(log, "rollout", PumpKind.PRODUCER, fails_on_cancel),
        pump(log, "sft", PumpKind.PRODUCER, fails_on_cancel),
        pump(log, "train", PumpKind.TERMINAL, fails_after(1, KeyError("step 4"))),
    ]
    with pytest.raises(PumpFailed) as caught:
        await run(pumps)
    assert caught.value.pump == "train"
    notes = caught.value.__notes__
    assert sorted(n.split("'")[1] for n in notes) == ["rollout", "sft"], notes


async def test_a_stage_is_told_its_upstream_ended_exactly_once(
    log: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    """Told when the producers end, and not again when other pumps end while it drains (the
    second producer at 2 s, the terminal at 3 s), nor once it has ended."""
    pumps: list[Pump] = [
        pump(log, "rollout", PumpKind.PRODUCER, after(1)),
        pump(log, "sft", PumpKind.PRODUCER, after(2)),
        stage(log, "teacher", drain_s=5),
        stage(log, "reward", drain_s=1),
        pump(log, "train", PumpKind.TERMINAL, after(3)),
    ]
    await run(pumps)
    assert log.count("teacher told") == 1 and log.count("reward told") == 1, log


def test_two_terminals_are_refused_naming_them(log: list[str]) -> None:
    first = pump(log, "train", PumpKind.TERMINAL, forever)
    second = pump(log, "eval", PumpKind.TERMINAL, forever)
    with pytest.raises(ValueError, match=r"exactly one TERMINAL pump, got \['train', 'eval'\]"):
        trio.run(lambda: supervise([first, second], shutdown_timeout_s=1.0))
    with pytest.raises(ValueError, match="exactly one TERMINAL pump, got none"):
        trio.run(lambda: supervise([], shutdown_timeout_s=1.0))


def test_the_shutdown_timeout_is_passed_by_name(log: list[str]) -> None:
    train = pump(log, "train", PumpKind.TERMINAL, forever)
    with pytest.raises(TypeError):
        trio.run(lambda: supervise([train], 1.0))  # type: ignore[call-arg]


# -- one error out of a pump's own nursery -------------------------------------------------


async def test_a_pumps_one_error_leaves_its_nursery_alone_with_its_own_cause() -> None:
    """The supervisor names the failure by its type; the cause (a teacher's OSError, say) is
    what the user reads to fix it."""

    async def fail() -> None:
        try:
            raise OSError("connection refused")
        except OSError as exc:
            raise RuntimeError("the teacher call failed") from exc

    with pytest.raises(RuntimeError, match="the teacher call failed") as caught:
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail)
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_pumps_error_that_met_a_cancellation_leaves_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled while one task's error was on its way out: the error, not a group of it and
    the cancellation, is what the caller sees."""

    async def fail_late() -> None:
        with trio.CancelScope(shield=True):
            await trio.sleep(2)
        raise ValueError("the late failure")

    with pytest.raises(ValueError, match="the late failure"):
        with trio.move_on_after(1), single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail_late)
                await trio.sleep_forever()


async def test_several_errors_of_a_pump_stay_grouped() -> None:
    async def fail(message: str) -> None:
        raise ValueError(message)

    with pytest.raises(ExceptionGroup) as caught:
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail, "one")
                nursery.start_soon(fail, "two")
    assert sorted(str(e) for e in caught.value.exceptions) == ["one", "two"]
