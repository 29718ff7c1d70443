"""The teacher backends: `score_teacher_batch` (DP padding, shards, checked output) over any
`Teacher`, routing agents to physical teachers, and the torch and Hugging Face teachers.

Teachers served by vLLM or another OpenAI-compatible server are in `groupflow.impl.engines`.
`TorchTeacher` and friends need torch (`pip install 'groupflow[torch]'`), `HFTeacher` and
`LlamaLM` and `GPT2LM` (the embedded models in architectures engines serve) also transformers
(`'groupflow[hf]'`), `RayTeacherGroup` (a teacher whose DP ranks are Ray actors)
Ray (`'groupflow[ray]'`): they are imported on first use, so this package and
`groupflow.impl` import without any of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from groupflow.impl.core import PAD_PREFIX, lazy_names
from groupflow.impl.teachers._batch import (
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
from groupflow.impl.teachers._routing import (
    AliasMap,
    RoutingConfig,
    resolve_teacher,
    router,
    teacher_by_agent,
)

if TYPE_CHECKING:
    from groupflow.impl.teachers._hf import HFTeacher
    from groupflow.impl.teachers._ray import ActorLoss, RayTeacherConfig, RayTeacherGroup
    from groupflow.impl.teachers._served_lm import (
        GPT2LM,
        GPT2LMConfig,
        LlamaLM,
        LlamaLMConfig,
        ServedLM,
    )
    from groupflow.impl.teachers._torch import (
        PRESETS,
        AnyLM,
        CausalLM,
        LMConfig,
        LogprobTeacher,
        TorchTeacher,
        batch_tolerance,
        new_lm,
        random_rows,
        reference_logprobs,
        resolve_device,
    )

_LAZY = {
    "PRESETS": "_torch",
    "AnyLM": "_torch",
    "new_lm": "_torch",
    "GPT2LM": "_served_lm",
    "GPT2LMConfig": "_served_lm",
    "LlamaLM": "_served_lm",
    "LlamaLMConfig": "_served_lm",
    "ServedLM": "_served_lm",
    "CausalLM": "_torch",
    "LMConfig": "_torch",
    "LogprobTeacher": "_torch",
    "TorchTeacher": "_torch",
    "batch_tolerance": "_torch",
    "random_rows": "_torch",
    "reference_logprobs": "_torch",
    "resolve_device": "_torch",
    "HFTeacher": "_hf",
    "ActorLoss": "_ray",
    "RayTeacherConfig": "_ray",
    "RayTeacherGroup": "_ray",
}
"""Names whose modules need an extra (torch, transformers, Ray), by module: loaded by
`__getattr__` on first use."""


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "LOGPROB_ROUNDING",
    "PAD_PREFIX",
    "TEACHER_INPUTS",
    "PRESETS",
    "ActorLoss",
    "AliasMap",
    "AnyLM",
    "BatchMeta",
    "CausalLM",
    "HFTeacher",
    "LMConfig",
    "GPT2LM",
    "GPT2LMConfig",
    "LlamaLM",
    "LlamaLMConfig",
    "ServedLM",
    "LogprobTeacher",
    "RayTeacherConfig",
    "RayTeacherGroup",
    "RoutingConfig",
    "TeacherBatchSteps",
    "TeacherScorer",
    "TorchTeacher",
    "batch_tolerance",
    "new_lm",
    "physical_teacher",
    "random_rows",
    "reference_logprobs",
    "resolve_device",
    "resolve_teacher",
    "router",
    "score_request",
    "score_teacher_batch",
    "teacher_batch_steps",
    "teacher_by_agent",
]
