"""Greedy decoding on the embedded task, and the accuracy it gives: one measure for teachers
(is this one good enough to distil from?) and for the student (how far has it got?).

Every prompt has `PROMPT_LENGTH` tokens and every answer `ANSWER_LENGTH`, so a batch decodes
without padding, one argmax per answer token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
from torch import nn

from groupflow.impl._teachers._torch import LogprobTeacher
from groupflow.impl._trainer._config import TrainConfig
from groupflow.impl._trainer._tasks import ANSWER_LENGTH, DOMAINS, Domain, Prompt, make_prompts
from groupflow.model.errors import ArgumentError

LogitsModel: TypeAlias = LogprobTeacher | nn.Module | Callable[[torch.Tensor], torch.Tensor]
"""What decodes: a teacher (its `logits`), or a model or function taking ids `[batch, seq]`
to logits `[batch, seq, vocab]` (`CausalLM` is one)."""


def _logits_fn(model: LogitsModel) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.device]:
    if isinstance(model, LogprobTeacher):
        teacher = model
        return (lambda ids: teacher.logits(ids, torch.ones_like(ids))), teacher.device
    if isinstance(model, nn.Module):
        first = next(model.parameters(), None)
        return model, first.device if first is not None else torch.device("cpu")
    return model, torch.device("cpu")


def greedy_answers(model: LogitsModel, prompts: Sequence[Prompt]) -> list[tuple[int, ...]]:
    """The `ANSWER_LENGTH` tokens greedy decoding appends to each prompt (no gradient; a
    module's train/eval mode is left as it was)."""
    if not prompts:
        return []
    logits_of, device = _logits_fn(model)
    ids = torch.tensor([p.tokens for p in prompts], dtype=torch.long, device=device)
    start = ids.shape[1]
    with torch.inference_mode():
        for _ in range(ANSWER_LENGTH):
            nxt = logits_of(ids)[:, -1].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
    return [tuple(row) for row in ids[:, start:].cpu().tolist()]


def greedy_accuracy(model: LogitsModel, domain: str | Domain, prompts: Sequence[Prompt]) -> float:
    """The share of `prompts` (all from `domain`) whose greedy answer is correct."""
    task = DOMAINS.get(domain) if isinstance(domain, str) else domain
    if task is None:
        raise ArgumentError(f"domain {domain!r} is not one of {sorted(DOMAINS)}")
    if not prompts:
        raise ArgumentError(f"no prompts to measure accuracy on in domain {task.name!r}")
    others = sorted({p.domain for p in prompts} - {task.name})
    if others:
        raise ArgumentError(
            f"greedy_accuracy for domain {task.name!r} got prompts from {others}: "
            f"measure each domain on its own prompts"
        )
    answers = greedy_answers(model, prompts)
    right = sum(task.correct(p, a) for p, a in zip(prompts, answers, strict=True))
    return right / len(prompts)


EVAL_SEED = 1_000
"""The held-out prompts' seed: far from the training prompts' (seed `config.seed`)."""


def greedy_accuracy_by_domain(model: nn.Module, config: TrainConfig) -> dict[str, float]:
    """The share of held-out prompts of each domain the model answers right, greedily."""
    return {
        name: greedy_accuracy(
            model, name, make_prompts(config.eval_prompts, domains=(name,), seed=EVAL_SEED)
        )
        for name in config.domains
    }
