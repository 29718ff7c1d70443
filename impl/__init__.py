"""The trio implementation of groupflow, and what its users call.

Three tiers, as trio has them:

- `groupflow.impl`: what a user of `build_pipeline` or of the buffer calls: the pipeline and its
  configuration, checkpoints, the protocols of the parts a user brings, the teacher backends,
  the served engines (a student and teachers on vLLM or another OpenAI-compatible server),
  the replay buffer and its store;
- `groupflow.impl.contract`: the protocols and the values the parts are handed, in one module
  (`TokenRow`, what a `Teacher` scores, is only there);
- `groupflow.impl.errors`: every error groupflow raises;
- `groupflow.impl.testing`: fakes of the parts that take virtual time, and an imitation of a
  vLLM server that fails on demand, for a user's own tests;
- `groupflow.impl.aio`: for asyncio trainers, the run hosted on their loop (`aio.run`) and
  parts written for asyncio (`aio.part`).

Inside, one subpackage per job, each importing only those before it (`core`, `pipeline`,
`teachers`, `engines`, `trainer`, `cli`); what they export beyond this is plumbing. The torch,
Hugging Face and Ray teachers and the TransferQueue store are imported on first use, so
`import groupflow.impl` needs none of their packages.
"""

import typing as _typing

from groupflow.impl import core as _core
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
from groupflow.impl.engines import ServedGenerator, ServedTeachers, VLLMServer
from groupflow.impl.pipeline import (
    TEACHER_FIELD,
    Checkpoint,
    CheckpointConfig,
    CheckpointPolicy,
    Design,
    Dispatch,
    ExtraStage,
    FailurePolicy,
    GenerateRequest,
    Generator,
    Learner,
    Pipeline,
    PipelineConfig,
    RunResult,
    Scorer,
    ScoreRequest,
    ScoringConfig,
    Shape,
    StallAction,
    StatelessLearner,
    StepRecord,
    Teacher,
    ThreadedScorer,
    TraceWriter,
    TrainBatch,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl.teachers import RoutingConfig, TeacherScorer, teacher_by_agent

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


__getattr__ = _core.lazy_names(
    __name__, {**dict.fromkeys(_LAZY, "teachers"), **dict.fromkeys(_LAZY_CORE, "core")}, globals()
)
"""The teachers and the store that need an extra (torch, Ray, TransferQueue), imported when
first asked for, from the subpackage that has them."""


__all__ = [
    "TEACHER_FIELD",
    "BufferConfig",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointPolicy",
    "Design",
    "Dispatch",
    "ExtraStage",
    "FailurePolicy",
    "GenerateRequest",
    "Generator",
    "HFTeacher",
    "LMConfig",
    "Learner",
    "MemoryStore",
    "Pipeline",
    "PipelineConfig",
    "RaySettings",
    "RayTeacherConfig",
    "RayTeacherGroup",
    "ReplayBuffer",
    "RoutingConfig",
    "Row",
    "RunResult",
    "SampleStore",
    "Sampler",
    "ScoreRequest",
    "Scorer",
    "ScoringConfig",
    "Shape",
    "ServedGenerator",
    "ServedTeachers",
    "Selection",
    "StallAction",
    "StatelessLearner",
    "StepRecord",
    "Teacher",
    "TeacherScorer",
    "ThreadedScorer",
    "TorchTeacher",
    "TraceWriter",
    "TrainBatch",
    "TransferQueueStore",
    "VLLMServer",
    "build_pipeline",
    "load_checkpoint",
    "ray_session",
    "teacher_by_agent",
]
