"""The on-policy distillation trainer: the embedded multi-domain task, domain teachers trained
on first use and cached, a student sampled and trained through the pipeline (`groupflow
train`). Needs torch (`pip install 'groupflow[train]'`): the names that use it are imported on
first use, so this package imports without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from groupflow.impl.trainer._tasks import (
    ANSWER_LENGTH,
    DOMAINS,
    PROMPT_LENGTH,
    TASK_VERSION,
    VOCAB,
    Domain,
    Prompt,
    domain_of,
    make_prompts,
)
from groupflow.impl.trainer._teacher_override import parse_teacher_override, teacher_from_path

if TYPE_CHECKING:
    from groupflow.impl.trainer._domain_teachers import (
        DEFAULT_RECIPE,
        TARGET_ACCURACY,
        TEACHER_CONFIG,
        TeacherRecipe,
        domain_teacher,
        held_out_prompts,
        train_domain_teacher,
    )
    from groupflow.impl.trainer._greedy import greedy_accuracy, greedy_answers
    from groupflow.impl.trainer._teacher_cache import default_cache_dir

_LAZY = {
    "DEFAULT_RECIPE": "_domain_teachers",
    "TARGET_ACCURACY": "_domain_teachers",
    "TEACHER_CONFIG": "_domain_teachers",
    "TeacherRecipe": "_domain_teachers",
    "domain_teacher": "_domain_teachers",
    "held_out_prompts": "_domain_teachers",
    "train_domain_teacher": "_domain_teachers",
    "greedy_accuracy": "_greedy",
    "greedy_answers": "_greedy",
    "default_cache_dir": "_teacher_cache",
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
    "DEFAULT_RECIPE",
    "DOMAINS",
    "PROMPT_LENGTH",
    "TARGET_ACCURACY",
    "TASK_VERSION",
    "TEACHER_CONFIG",
    "VOCAB",
    "Domain",
    "Prompt",
    "TeacherRecipe",
    "default_cache_dir",
    "domain_of",
    "domain_teacher",
    "greedy_accuracy",
    "greedy_answers",
    "held_out_prompts",
    "make_prompts",
    "parse_teacher_override",
    "teacher_from_path",
    "train_domain_teacher",
]
