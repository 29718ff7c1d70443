"""The trio implementation of groupflow, and what its users call.

Public, as trio has it:

- `groupflow.impl`: what a user of `build_pipeline` or of the buffer calls: the pipeline and its
  configuration, checkpoints, the contract (below), the teacher backends, the served engines (a
  student and teachers on vLLM or another OpenAI-compatible server), the replay buffer and its
  store;
- `groupflow.impl.contract`: the protocols of the parts a user brings and the values they are
  handed, in one module;
- `groupflow.impl.errors`: every error groupflow raises;
- `groupflow.impl.testing`: fakes of the parts that take virtual time, and an imitation of a
  vLLM server that fails on demand, for a user's own tests;
- `groupflow.impl.engines`: the served engines;
- `groupflow.impl.aio`: for asyncio trainers, the run hosted on their loop (`aio.run`) and
  parts written for asyncio (`aio.part`).

Internal, and named so: `_core`, `_pipeline`, `_teachers`, `_trainer`, each importing only those
before it. The torch, Hugging Face and Ray teachers and the TransferQueue store are imported on
first use, so `import groupflow.impl` needs none of their packages.
"""

import typing as _typing

from groupflow.impl import _core
from groupflow.impl import contract as _contract
from groupflow.impl._core import (
    BufferConfig,
    MemoryStore,
    RaySettings,
    ReplayBuffer,
    Row,
    Sampler,
    SampleStore,
    Selection,
    keep_ray_local,
    ray_session,
)
from groupflow.impl._pipeline import (
    DEFAULT_TRANSIENT_ERRORS,
    Checkpoint,
    CheckpointConfig,
    CheckpointPolicy,
    Design,
    Dispatch,
    ExtraStage,
    FailurePolicy,
    Pipeline,
    PipelineConfig,
    RunResult,
    ScoringConfig,
    Shape,
    StallAction,
    StepRecord,
    ThreadedScorer,
    TraceWriter,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl._teachers import RoutingConfig, TeacherScorer, teacher_by_agent
from groupflow.impl.contract import *  # noqa: F403 (each name once: the contract's __all__)
from groupflow.impl.engines import ServedGenerator, ServedTeachers, VLLMServer

if _typing.TYPE_CHECKING:
    from groupflow.impl._core._tq_store import TransferQueueStore
    from groupflow.impl._teachers._hf import HFTeacher
    from groupflow.impl._teachers._ray import RayTeacherConfig, RayTeacherGroup
    from groupflow.impl._teachers._torch import LMConfig, TorchTeacher

_LAZY = {
    "HFTeacher": "_teachers._hf",
    "LMConfig": "_teachers._torch",
    "RayTeacherConfig": "_teachers._ray",
    "RayTeacherGroup": "_teachers._ray",
    "TorchTeacher": "_teachers._torch",
    "TransferQueueStore": "_core._tq_store",
}
"""The teachers and the store that need an extra (torch, Ray, TransferQueue), by module:
imported when first asked for."""

__getattr__ = _core.lazy_names(__name__, _LAZY, globals())

__all__ = [
    "DEFAULT_TRANSIENT_ERRORS",
    "BufferConfig",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointPolicy",
    "Design",
    "Dispatch",
    "ExtraStage",
    "FailurePolicy",
    "HFTeacher",
    "LMConfig",
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
    "ScoringConfig",
    "Selection",
    "ServedGenerator",
    "ServedTeachers",
    "Shape",
    "StallAction",
    "StepRecord",
    "TeacherScorer",
    "ThreadedScorer",
    "TorchTeacher",
    "TraceWriter",
    "TransferQueueStore",
    "VLLMServer",
    "build_pipeline",
    "load_checkpoint",
    "keep_ray_local",
    "ray_session",
    "teacher_by_agent",
]
__all__ += _contract.__all__
