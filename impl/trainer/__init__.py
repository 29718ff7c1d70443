"""The on-policy distillation trainer (`groupflow train`): the embedded multi-domain task, domain
teachers trained on first use and cached, and a student sampled and trained through the
pipeline. What needs torch (`pip install 'groupflow[train]'`) is imported on first use, so this
package imports without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from groupflow.impl.trainer._config import TrainConfig
from groupflow.impl.trainer._tasks import (
    ANSWER_LENGTH,
    DOMAINS,
    PROMPT_LENGTH,
    VOCAB,
    Domain,
    Prompt,
    domain_of,
    make_prompts,
)

if TYPE_CHECKING:
    from groupflow.impl.trainer._generator import StudentGenerator
    from groupflow.impl.trainer._learner import DistillLearner, LossParts, distill_loss
    from groupflow.impl.trainer._run import (
        DomainTeacher,
        TrainSummary,
        format_summary,
        progress_bar,
        provide_teachers,
        train,
    )
    from groupflow.impl.trainer._student import (
        greedy_responses,
        new_student,
        response_logprobs,
        sample,
        student_config,
    )

_LAZY = {
    "StudentGenerator": "_generator",
    "DistillLearner": "_learner",
    "LossParts": "_learner",
    "distill_loss": "_learner",
    "DomainTeacher": "_run",
    "TrainSummary": "_run",
    "format_summary": "_run",
    "progress_bar": "_run",
    "provide_teachers": "_run",
    "train": "_run",
    "greedy_responses": "_student",
    "new_student": "_student",
    "response_logprobs": "_student",
    "sample": "_student",
    "student_config": "_student",
}
"""Names whose modules import torch, by module: loaded by `__getattr__` on first use."""


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ANSWER_LENGTH",
    "DOMAINS",
    "PROMPT_LENGTH",
    "VOCAB",
    "DistillLearner",
    "Domain",
    "DomainTeacher",
    "LossParts",
    "Prompt",
    "StudentGenerator",
    "TrainConfig",
    "TrainSummary",
    "distill_loss",
    "domain_of",
    "format_summary",
    "greedy_responses",
    "make_prompts",
    "new_student",
    "progress_bar",
    "provide_teachers",
    "response_logprobs",
    "sample",
    "student_config",
    "train",
]
