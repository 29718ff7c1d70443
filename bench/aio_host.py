"""What hosting on asyncio costs (`groupflow.impl.aio`), side by side in one run.

Run: `python bench/aio_host.py` (about a minute; `--steps`, `--calls`). It prints:

- **a bridged call**: an asyncio part's `async def` method awaited from trio on the asyncio host
  (`aio.part`: a task on the loop, its result handed back), against the same method awaited by
  asyncio code directly (the bridge's cost is the difference), and its trio twin awaited by trio
  code, in microseconds per call (medians of `--repeats`): one that returns at once, and one
  that waits 500 us on its loop (trio parks meanwhile, and is woken through its I/O thread: the
  cost of a call that does real I/O);
- **the host loop's delay** while the embedded task trains (`groupflow train`'s run, `--steps`
  steps): a ticker on the run's loop sleeps 1 ms again and again and records how late it wakes
  (p50, p99, max). Three runs: under trio (the ticker a trio task), hosted on asyncio (the
  ticker an asyncio task beside the run, as a trainer's own pumps are), and hosted on asyncio
  with the learner computing on the loop's thread (`learner on the loop`: what the embedded
  learner would cost the loop if it computed there).
Goals: under 100 us a call, and a p99 delay under 5 ms on the embedded task.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from groupflow.impl import aio

TICK_S = 0.001
WAIT_S = 0.0005


class _Echo:
    async def echo(self, value: int, wait_s: float) -> int:
        if wait_s:
            await asyncio.sleep(wait_s)
        return value


class _TrioEcho:
    async def echo(self, value: int, wait_s: float) -> int:
        if wait_s:
            await trio.sleep(wait_s)
        else:
            await trio.lowlevel.checkpoint()
        return value


def _per_call_us(calls: int, repeats: int, wait_s: float) -> tuple[float, float, float]:
    """Microseconds per call of a method that waits `wait_s` on its loop (0: returns at once):
    an asyncio part bridged (awaited from trio on the asyncio host), the same method awaited
    by asyncio code directly, and its trio twin awaited by trio code (medians)."""

    async def timed(part: Any) -> float:
        began = time.perf_counter()
        for i in range(calls):
            await part.echo(i, wait_s)
        return (time.perf_counter() - began) / calls * 1e6

    bridged, direct, native = [], [], []
    for _ in range(repeats):
        bridged.append(asyncio.run(aio.host(timed, aio.part(_Echo()), drain_s=5)))
        direct.append(asyncio.run(timed(_Echo())))
        native.append(trio.run(timed, _TrioEcho()))
    return statistics.median(bridged), statistics.median(direct), statistics.median(native)


def _percentiles(delays: list[float]) -> str:
    ms = sorted(d * 1000 for d in delays)
    p50 = ms[len(ms) // 2]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  max {ms[-1]:7.2f} ms  ({len(ms)} ticks)"


def _train(steps: int, folder: Path) -> tuple[Callable[[], Awaitable[Any]], Any]:
    from groupflow.impl._trainer import RunFolder, TrainConfig
    from groupflow.impl._trainer._provision import provide_teachers
    from groupflow.impl._trainer._run import train

    config = TrainConfig(steps=steps)
    teachers = provide_teachers(config)

    async def run() -> Any:
        return await train(
            RunFolder.new(folder, config),
            teachers=teachers,
            progress=None,
            plot=False,
            say=lambda s: None,
        )

    return run, config


def _under_trio(steps: int, folder: Path) -> tuple[list[float], Any]:
    run, _ = _train(steps, folder)
    delays: list[float] = []

    async def main() -> Any:
        async with trio.open_nursery() as nursery:

            async def tick() -> None:
                while True:
                    began = trio.current_time()
                    await trio.sleep(TICK_S)
                    delays.append(trio.current_time() - began - TICK_S)

            nursery.start_soon(tick)
            summary = await run()
            nursery.cancel_scope.cancel()
        return summary

    return delays, trio.run(main)


def _hosted(steps: int, folder: Path) -> tuple[list[float], Any]:
    run, config = _train(steps, folder)
    delays: list[float] = []

    async def main() -> Any:
        loop = asyncio.get_running_loop()

        async def tick() -> None:
            while True:
                began = loop.time()
                await asyncio.sleep(TICK_S)
                delays.append(loop.time() - began - TICK_S)

        ticker = asyncio.create_task(tick())
        try:
            return await aio.host(run, drain_s=60)
        finally:
            ticker.cancel()

    return delays, asyncio.run(main())


def _learner_on_the_loop() -> Callable[[], None]:
    """The embedded learner computing on the loop's thread: what it did before it moved to a
    worker thread. Returns the undo."""
    from groupflow.impl._trainer._learner import DistillLearner

    moved = DistillLearner.train_step

    async def on_the_loop(self: Any, batch: Any) -> Any:
        return self._train_step(batch)

    DistillLearner.train_step = on_the_loop  # type: ignore[method-assign]

    def undo() -> None:
        DistillLearner.train_step = moved  # type: ignore[method-assign]

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    print(f"a call, median of {args.repeats} runs:")
    for wait_s, calls, what in (
        (0.0, args.calls, "that returns at once"),
        (WAIT_S, args.calls // 10, f"that waits {WAIT_S * 1e6:.0f} us on its loop"),
    ):
        bridged, direct, native = _per_call_us(calls, args.repeats, wait_s)
        print(f"  {what} ({calls} calls):")
        print(f"    asyncio part, bridged      {bridged:7.1f} us")
        print(f"    asyncio part, from asyncio {direct:7.1f} us")
        print(f"    trio part, from trio       {native:7.1f} us")
        print(f"    the bridge's cost          {bridged - direct:7.1f} us a call (goal < 100)")
    print(f"\nthe run loop's delay while the embedded task trains {args.steps} steps:")
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, runner in (("under trio", _under_trio), ("hosted on asyncio", _hosted)):
            delays, summary = runner(args.steps, Path(tmp) / name.replace(" ", "-"))
            rows.append((name, delays, summary))
        undo = _learner_on_the_loop()
        try:
            delays, summary = _hosted(args.steps, Path(tmp) / "on-the-loop")
        finally:
            undo()
        rows.append(("asyncio, learner on loop", delays, summary))
    for name, delays, summary in rows:
        print(
            f"  {name:<25} {_percentiles(delays)}  {summary.steps_per_s:5.2f} steps/s  "
            f"KL {summary.kl_first:.3f} -> {summary.kl_last:.3f}"
        )


if __name__ == "__main__":
    main()
