"""The trio implementation of groupflow, and what its users call.

Inside, one subpackage per job, each importing only those before it:

- `groupflow.impl.core`: where rows live, the replay buffer, the prompt ledger;
- `groupflow.impl.pipeline`: the pumps, their supervisor, the controller, checkpoints;
- `groupflow.impl.teachers`: `score_teacher_batch`, routing, the torch and Hugging Face teachers;
- `groupflow.impl.cli`: the `groupflow` command line.

This module exports what the README tells users to call; the wiring stays in the subpackages.
Every error groupflow raises is here too (defined in `groupflow.model.errors`). The torch and
Hugging Face teachers are imported on first use, so `import groupflow.impl` needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from groupflow.impl import teachers as _teachers
from groupflow.impl.core import (
    BufferConfig,
    BufferFull,
    DuplicateDataError,
    MemoryStore,
    MissingDataError,
    ReplayBuffer,
    Row,
    Sampler,
    SampleStore,
    Selection,
    UnknownGroup,
)
from groupflow.impl.pipeline import (
    CheckpointMismatch,
    Dispatch,
    GenerateRequest,
    Generator,
    Learner,
    MonitorReturned,
    Pipeline,
    PipelineConfig,
    PumpFailed,
    RoutingError,
    RunResult,
    Scorer,
    ScoreRequest,
    ScoringConfig,
    ShutdownTimeout,
    StallAction,
    Stalled,
    StepRecord,
    TeacherCallFailed,
    ThreadedScorer,
    TrainBatch,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl.teachers import (
    AliasMap,
    BatchMeta,
    RoutingConfig,
    Teacher,
    TeacherOutputError,
    TeacherScorer,
    TokenRow,
    resolve_teacher,
    router,
    score_teacher_batch,
    teacher_by_agent,
)
from groupflow.model import IllegalTransition

if TYPE_CHECKING:
    from groupflow.impl.teachers import HFTeacher, LMConfig, TorchTeacher

_LAZY = ("HFTeacher", "LMConfig", "TorchTeacher")


def __getattr__(name: str) -> Any:
    """The teachers that need torch, imported when first asked for."""
    if name in _LAZY:
        value = getattr(_teachers, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AliasMap",
    "BatchMeta",
    "BufferConfig",
    "BufferFull",
    "CheckpointMismatch",
    "Dispatch",
    "DuplicateDataError",
    "GenerateRequest",
    "Generator",
    "HFTeacher",
    "IllegalTransition",
    "LMConfig",
    "Learner",
    "MemoryStore",
    "MissingDataError",
    "MonitorReturned",
    "Pipeline",
    "PipelineConfig",
    "PumpFailed",
    "ReplayBuffer",
    "RoutingConfig",
    "RoutingError",
    "Row",
    "RunResult",
    "SampleStore",
    "Sampler",
    "ScoreRequest",
    "Scorer",
    "ScoringConfig",
    "Selection",
    "ShutdownTimeout",
    "StallAction",
    "Stalled",
    "StepRecord",
    "Teacher",
    "TeacherCallFailed",
    "TeacherOutputError",
    "TeacherScorer",
    "ThreadedScorer",
    "TokenRow",
    "TorchTeacher",
    "TrainBatch",
    "UnknownGroup",
    "build_pipeline",
    "load_checkpoint",
    "resolve_teacher",
    "router",
    "score_teacher_batch",
    "teacher_by_agent",
]
