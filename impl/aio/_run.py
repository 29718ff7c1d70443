"""`aio.run`: a pipeline's run, awaited from asyncio code."""

from __future__ import annotations

import sys
from collections.abc import Callable

from groupflow.impl._pipeline import Checkpoint, Pipeline, RunResult
from groupflow.impl.aio._host import host


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr)


async def run(
    pipeline: Pipeline,
    *,
    resume: Checkpoint | None = None,
    interrupts: bool = True,
    say: Callable[[str], None] = _to_stderr,
) -> RunResult:
    """Run `pipeline` (resumed from `resume` first, when given) on the running asyncio loop,
    and return its `RunResult`; a failed run raises its one error (`PumpFailed`, say), as
    under trio.

    - Cancelling the task awaiting this cancels the run: it drains as a cancelled trio run
      does (groups dropped, rows cleared, the checkpoint folder unlocked; at most twice
      `shutdown_timeout_s`), then `CancelledError` is raised.
    - With `interrupts` (in the main thread), Ctrl-C is `groupflow train`'s: the first stops
      the run after the step in progress and saves a checkpoint (`say` tells the user), a
      second quits at once with `KeyboardInterrupt`.
    - While it runs, asyncio code may read `pipeline.status`, call `pipeline.request_stop()`,
      and hear each step through `build_pipeline(on_step=...)`, which is called on the loop's
      thread and must not block (hand the record over with `queue.put_nowait`)."""

    async def main() -> RunResult:
        if resume is not None:
            await pipeline.resume_from(resume)
        if interrupts:
            return await pipeline.run_until_interrupted(say)
        return await pipeline.run()

    bound = pipeline.config.shutdown_timeout_s
    return await host(main, drain_s=2 * bound, abandon_after_s=bound)
