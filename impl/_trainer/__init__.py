"""Internal: the on-policy distillation trainer behind `groupflow train` (the embedded
multi-domain task, domain teachers trained on first use and cached, a student sampled and trained
through the pipeline, in this process or on vLLM servers).

Exports the names that import without torch; the modules that need torch (`_run`, `_student`,
`_learner`, ...) are imported by name where they are used, so this package imports without it.
"""

from __future__ import annotations

from groupflow.impl._trainer._config import Engine, TrainConfig
from groupflow.impl._trainer._run_folder import RunFolder
from groupflow.impl._trainer._tasks import (
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
from groupflow.impl._trainer._teacher_override import parse_teacher_override, teacher_from_path
from groupflow.impl._trainer._verifier import REWARD_FIELD, VERIFIER, Verifier, verifier_stage

__all__ = [
    "ANSWER_LENGTH",
    "DOMAINS",
    "PROMPT_LENGTH",
    "REWARD_FIELD",
    "TASK_VERSION",
    "VERIFIER",
    "VOCAB",
    "Verifier",
    "Domain",
    "Engine",
    "Prompt",
    "TrainConfig",
    "RunFolder",
    "domain_of",
    "make_prompts",
    "parse_teacher_override",
    "teacher_from_path",
    "verifier_stage",
]
