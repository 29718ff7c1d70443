"""The trio implementation of groupflow, and what its users call.

Inside, one subpackage per job, each importing only those before it:

- `groupflow.impl.core`: where rows live, the replay buffer, the prompt ledger;
- `groupflow.impl.pipeline`: the pumps, their supervisor, the controller, checkpoints;
- `groupflow.impl.teachers`: `score_teacher_batch`, routing, the torch and Hugging Face teachers,
  the Ray teacher worker group;
- `groupflow.impl.cli`: the `groupflow` command line.

This module exports what the README tells users to call; the wiring stays in the subpackages.
Every error groupflow raises is here too (defined in `groupflow.model.errors`). The torch,
Hugging Face and Ray teachers and the TransferQueue store are imported on first use, so
`import groupflow.impl` needs none of their packages.
"""

import typing as _typing

from groupflow.impl import core as _core
from groupflow.impl import teachers as _teachers
from groupflow.impl.core import (
    BufferConfig,
    MemoryStore,
    RaySettings,
    ReplayBuffer,
    Row,
    Sampler,
    SampleStore,
    Selection,
    ray_session,
)
from groupflow.impl.pipeline import (
    TEACHER_FIELD,
    TRACE_FILE,
    TRACE_FORMAT,
    Checkpoint,
    Dispatch,
    ExtraStage,
    GenerateRequest,
    Generator,
    Learner,
    Pipeline,
    PipelineConfig,
    RunResult,
    Scorer,
    ScoreRequest,
    ScoringConfig,
    StallAction,
    StatelessLearner,
    StepRecord,
    ThreadedScorer,
    TraceWriter,
    TrainBatch,
    build_pipeline,
    digest_data,
    load_checkpoint,
)
from groupflow.impl.teachers import (
    AliasMap,
    BatchMeta,
    RoutingConfig,
    Teacher,
    TeacherScorer,
    TokenRow,
    resolve_teacher,
    router,
    score_teacher_batch,
    teacher_by_agent,
)
from groupflow.model.errors import (
    ArgumentError,
    BackpressureError,
    BufferFull,
    CallOrderError,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointExists,
    CheckpointLocked,
    CheckpointMismatch,
    CheckpointNotFound,
    ConfigError,
    ConformanceError,
    DuplicateDataError,
    Exhausted,
    ExternalError,
    GeneratorOutputError,
    GroupBusy,
    GroupflowError,
    IllegalTransition,
    InternalError,
    InvariantViolation,
    LedgerInconsistent,
    MissingDataError,
    MonitorReturned,
    NotEnabled,
    NothingTrained,
    PumpFailed,
    RolloutsFailed,
    RoutingError,
    ShutdownTimeout,
    Stalled,
    StoreError,
    StoreTimeout,
    TeacherCallFailed,
    TeacherError,
    TeacherLost,
    TeacherOutputError,
    TeacherTimeout,
    TeacherUntrained,
    TraceCorrupt,
    TraceError,
    TraceNotFound,
    TransientError,
    Unavailable,
    UnknownGroup,
    UsageError,
)

if _typing.TYPE_CHECKING:
    from groupflow.impl.core import TransferQueueStore
    from groupflow.impl.teachers import (
        HFTeacher,
        LMConfig,
        RayTeacherConfig,
        RayTeacherGroup,
        TorchTeacher,
    )

_LAZY = ("HFTeacher", "LMConfig", "RayTeacherConfig", "RayTeacherGroup", "TorchTeacher")
_LAZY_CORE = ("TransferQueueStore",)


def __getattr__(name: str) -> object:
    """The teachers and the store that need an extra (torch, Ray, TransferQueue), imported
    when first asked for."""
    if name in _LAZY or name in _LAZY_CORE:
        value = getattr(_teachers if name in _LAZY else _core, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TEACHER_FIELD",
    "AliasMap",
    "ArgumentError",
    "BackpressureError",
    "BatchMeta",
    "BufferConfig",
    "BufferFull",
    "CallOrderError",
    "Checkpoint",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointLocked",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "ConfigError",
    "ConformanceError",
    "Dispatch",
    "DuplicateDataError",
    "Exhausted",
    "ExternalError",
    "GenerateRequest",
    "Generator",
    "GeneratorOutputError",
    "GroupBusy",
    "GroupflowError",
    "HFTeacher",
    "IllegalTransition",
    "InternalError",
    "InvariantViolation",
    "LMConfig",
    "Learner",
    "LedgerInconsistent",
    "MemoryStore",
    "MissingDataError",
    "MonitorReturned",
    "NotEnabled",
    "NothingTrained",
    "Pipeline",
    "PipelineConfig",
    "PumpFailed",
    "RaySettings",
    "RayTeacherConfig",
    "RayTeacherGroup",
    "ReplayBuffer",
    "RoutingConfig",
    "RolloutsFailed",
    "RoutingError",
    "Row",
    "RunResult",
    "SampleStore",
    "Sampler",
    "ExtraStage",
    "ScoreRequest",
    "Scorer",
    "ScoringConfig",
    "Selection",
    "ShutdownTimeout",
    "StallAction",
    "Stalled",
    "StatelessLearner",
    "StepRecord",
    "StoreError",
    "StoreTimeout",
    "Teacher",
    "TeacherCallFailed",
    "TeacherError",
    "TeacherLost",
    "TeacherOutputError",
    "TeacherTimeout",
    "TeacherUntrained",
    "TeacherScorer",
    "ThreadedScorer",
    "TokenRow",
    "TorchTeacher",
    "TRACE_FILE",
    "TRACE_FORMAT",
    "TraceCorrupt",
    "TraceError",
    "TraceNotFound",
    "TraceWriter",
    "TrainBatch",
    "TransferQueueStore",
    "TransientError",
    "Unavailable",
    "UnknownGroup",
    "UsageError",
    "build_pipeline",
    "digest_data",
    "load_checkpoint",
    "ray_session",
    "resolve_teacher",
    "router",
    "score_teacher_batch",
    "teacher_by_agent",
]
