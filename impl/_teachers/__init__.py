"""Internal: the teacher backends behind `TeacherScorer`: `score_teacher_batch` (DP padding,
shards, checked output) over any `Teacher`, and routing agents to physical teachers.

Exports the names that import without extras; the torch, Hugging Face and Ray teachers (`_torch`,
`_hf`, `_served_lm`, `_ray`) are imported by name where they are used, and reach users through
`groupflow.impl`.
"""

from __future__ import annotations

from groupflow.impl._core import PAD_PREFIX
from groupflow.impl._teachers._batch import (
    LOGPROB_ROUNDING,
    TEACHER_INPUTS,
    BatchMeta,
    TeacherBatchSteps,
    TeacherScorer,
    physical_teacher,
    score_request,
    score_teacher_batch,
    teacher_batch_steps,
)
from groupflow.impl._teachers._probe import (
    PROBE_FILE,
    PROBE_REPEATS,
    ProbeCall,
    probe_teachers,
    read_probe,
    stored_groups,
    write_probe,
)
from groupflow.impl._teachers._routing import (
    AliasMap,
    RoutingConfig,
    resolve_teacher,
    router,
    teacher_by_agent,
)

__all__ = [
    "LOGPROB_ROUNDING",
    "PAD_PREFIX",
    "PROBE_FILE",
    "PROBE_REPEATS",
    "TEACHER_INPUTS",
    "AliasMap",
    "BatchMeta",
    "ProbeCall",
    "RoutingConfig",
    "TeacherBatchSteps",
    "TeacherScorer",
    "physical_teacher",
    "probe_teachers",
    "read_probe",
    "resolve_teacher",
    "router",
    "score_request",
    "score_teacher_batch",
    "stored_groups",
    "teacher_batch_steps",
    "teacher_by_agent",
    "write_probe",
]
