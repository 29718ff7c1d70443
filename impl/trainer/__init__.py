"""The on-policy distillation trainer: the embedded multi-domain task, domain teachers trained
on first use and cached, a student sampled and trained through the pipeline (`groupflow
train`). Needs torch (`pip install 'groupflow[train]'`), imported on first use.
"""

from __future__ import annotations

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

__all__ = [
    "ANSWER_LENGTH",
    "DOMAINS",
    "PROMPT_LENGTH",
    "VOCAB",
    "Domain",
    "Prompt",
    "domain_of",
    "make_prompts",
]
