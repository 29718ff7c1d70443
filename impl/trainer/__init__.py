"""The on-policy distillation trainer (`groupflow train`): the embedded multi-domain task, domain
teachers trained on first use and cached, and a student sampled and trained through the
pipeline, in this process or on vLLM servers (`served_engines`). What needs torch (`pip install 'groupflow[train]'`) is imported on first use, so this
package imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from groupflow.impl.core import lazy_names
from groupflow.impl.trainer._config import Engine, TrainConfig
from groupflow.impl.trainer._run_folder import RunFolder
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
from groupflow.impl.trainer._verifier import REWARD_FIELD, VERIFIER, Verifier, verifier_stage

if TYPE_CHECKING:
    from groupflow.impl.trainer._domain_teachers import (
        DEFAULT_RECIPE,
        ENGINE_RECIPE,
        TARGET_ACCURACY,
        TEACHER_CONFIG,
        TeacherRecipe,
        domain_teacher,
        held_out_prompts,
        train_domain_teacher,
    )
    from groupflow.impl.trainer._engines import RunEngines, check_engine_needs, served_engines
    from groupflow.impl.trainer._generator import StudentGenerator
    from groupflow.impl.trainer._greedy import greedy_accuracy, greedy_answers
    from groupflow.impl.trainer._learner import DistillLearner, LossParts, distill_loss
    from groupflow.impl.trainer._provision import DomainTeacher, provide_teachers, teacher_choices
    from groupflow.impl.trainer._run import train
    from groupflow.impl.trainer._student import (
        new_student,
        response_logprobs,
        sample,
        student_config,
    )
    from groupflow.impl.trainer._summary import TrainSummary, format_summary, progress_bar
    from groupflow.impl.trainer._teacher_cache import default_cache_dir

_LAZY = {
    "DEFAULT_RECIPE": "_domain_teachers",
    "ENGINE_RECIPE": "_domain_teachers",
    "RunEngines": "_engines",
    "served_engines": "_engines",
    "check_engine_needs": "_engines",
    "TARGET_ACCURACY": "_domain_teachers",
    "TEACHER_CONFIG": "_domain_teachers",
    "TeacherRecipe": "_domain_teachers",
    "domain_teacher": "_domain_teachers",
    "held_out_prompts": "_domain_teachers",
    "train_domain_teacher": "_domain_teachers",
    "StudentGenerator": "_generator",
    "greedy_accuracy": "_greedy",
    "greedy_answers": "_greedy",
    "DistillLearner": "_learner",
    "LossParts": "_learner",
    "distill_loss": "_learner",
    "DomainTeacher": "_provision",
    "TrainSummary": "_summary",
    "format_summary": "_summary",
    "progress_bar": "_summary",
    "provide_teachers": "_provision",
    "teacher_choices": "_provision",
    "train": "_run",
    "new_student": "_student",
    "response_logprobs": "_student",
    "sample": "_student",
    "student_config": "_student",
    "default_cache_dir": "_teacher_cache",
}
"""Names whose modules import torch, by module: loaded by `__getattr__` on first use."""


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "ANSWER_LENGTH",
    "DEFAULT_RECIPE",
    "DOMAINS",
    "ENGINE_RECIPE",
    "PROMPT_LENGTH",
    "REWARD_FIELD",
    "TARGET_ACCURACY",
    "TASK_VERSION",
    "TEACHER_CONFIG",
    "VERIFIER",
    "VOCAB",
    "Verifier",
    "DistillLearner",
    "Domain",
    "DomainTeacher",
    "Engine",
    "LossParts",
    "Prompt",
    "RunEngines",
    "StudentGenerator",
    "TeacherRecipe",
    "TrainConfig",
    "TrainSummary",
    "RunFolder",
    "default_cache_dir",
    "distill_loss",
    "domain_of",
    "domain_teacher",
    "format_summary",
    "greedy_accuracy",
    "greedy_answers",
    "held_out_prompts",
    "make_prompts",
    "new_student",
    "parse_teacher_override",
    "progress_bar",
    "provide_teachers",
    "teacher_choices",
    "response_logprobs",
    "sample",
    "served_engines",
    "check_engine_needs",
    "student_config",
    "teacher_from_path",
    "train",
    "train_domain_teacher",
    "verifier_stage",
]
