"""Teachers written for asyncio: `teacher_scorer` scores the stage's requests on them as
`TeacherScorer` does on blocking ones (padding to `dp_size`, one shard per rank, every value
checked, the padding rows cleared whatever happens), awaiting `score_shards` on the host loop
instead of calling it in a worker thread."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from groupflow.impl._pipeline import part_name
from groupflow.impl._teachers import (
    TEACHER_INPUTS,
    BatchMeta,
    physical_teacher,
    teacher_batch_steps,
)
from groupflow.impl.aio._part import AsyncioPart, call_serving, part
from groupflow.impl.contract import ScoreRequest
from groupflow.model.errors import ArgumentError


@attrs.frozen
class _AsyncioTeacherScorer:
    groupflow_host: ClassVar[str] = "asyncio"
    """What `Pipeline.run` looks for: the teachers' calls need an asyncio loop."""

    teachers: Mapping[str, AsyncioPart]
    reads: ClassVar[frozenset[str]] = TEACHER_INPUTS

    async def score(self, request: ScoreRequest) -> None:
        teacher = physical_teacher(self.teachers, request)
        meta = BatchMeta(request.sample_ids)
        steps = teacher_batch_steps(request.store, teacher, meta, field=request.field)
        try:
            shards = next(steps)
            try:
                results = await call_serving(teacher, "score_shards", request, shards)
            except BaseException as error:
                steps.throw(error)  # clears the padding rows, and raises it again
                raise
            steps.send(results)
        except StopIteration:
            return


def teacher_scorer(teachers: Mapping[str, Any]) -> Any:
    """The stage's scorer over teachers written for asyncio (each a `Teacher` whose
    `score_shards` is `async def`), by name, as `TeacherScorer` takes blocking ones. Pass it
    to `build_pipeline(scorer=...)`; run the pipeline with `aio.run`."""
    if not isinstance(teachers, Mapping) or not teachers:
        raise ArgumentError(
            f"groupflow.impl.aio.teacher_scorer() takes the teachers by name, "
            f"{{name: teacher, ...}}; got {teachers!r}"
        )
    blocking = [
        f"{name!r} ({part_name(t)})"
        for name, t in teachers.items()
        if not inspect.iscoroutinefunction(getattr(t, "score_shards", None))
    ]
    if blocking:
        raise ArgumentError(
            f"teacher {blocking[0]} has no `async def score_shards`: "
            f"groupflow.impl.aio.teacher_scorer is for asyncio teachers; give a blocking one "
            f"to ThreadedScorer(TeacherScorer(...))"
        )
    return _AsyncioTeacherScorer({name: part(t) for name, t in teachers.items()})
