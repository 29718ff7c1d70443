"""groupflow from asyncio: the pipeline hosted on the running asyncio loop, and parts written
for asyncio.

    result = await groupflow.impl.aio.run(pipeline, resume=checkpoint)

runs the pipeline exactly as `trio.run` would (the same checks, the same `RunResult`, the
same one error when it fails) in trio's guest mode on the loop the caller runs on: one
thread, no trio-asyncio. A generator, learner or scorer written for asyncio is declared with
`part(obj)`; its `async def` methods run as asyncio tasks on that loop. Teachers whose
`score_shards` is `async def` go to the stage through `teacher_scorer({name: teacher})`. `host` runs any
groupflow trio function the same way (`groupflow train --host asyncio` hosts the whole run);
`start_guest` starts one on a loop the caller drives itself (the pipeline machine's host).
The rules for asyncio code beside a run are in docs/asyncio.md.
"""

from groupflow.impl.aio._host import GuestRun, host, start_guest
from groupflow.impl.aio._part import AsyncioPart, part
from groupflow.impl.aio._run import run
from groupflow.impl.aio._teacher import teacher_scorer

__all__ = ["AsyncioPart", "GuestRun", "host", "part", "run", "start_guest", "teacher_scorer"]
