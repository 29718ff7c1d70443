"""Domain teachers for the embedded task: trained on first use, then cached.

A distillation run needs a teacher per domain that actually solves it, and a user of the
default run should not have to ship one. So `domain_teacher` trains a small model (`CausalLM`,
or `LlamaLM` for a run on an inference engine) on its
domain (teacher-forced cross-entropy on the answer tokens, Adam, every draw seeded) until greedy
decoding solves held-out prompts, and caches it: the next call loads the same weights without
training. A cached file that is damaged or made under another recipe is rebuilt, with a warning
naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from groupflow.impl._core import default_cache_dir
from groupflow.impl._teachers._served_lm import LlamaLMConfig
from groupflow.impl._teachers._torch import LMConfig, TorchTeacher
from groupflow.impl._trainer import _teacher_cache
from groupflow.impl._trainer._greedy import greedy_accuracy
from groupflow.impl._trainer._student import ENGINE_CONTEXT
from groupflow.impl._trainer._tasks import (
    ANSWER_LENGTH,
    DOMAINS,
    PROMPT_LENGTH,
    TASK_VERSION,
    VOCAB,
    Domain,
    Prompt,
    make_prompts,
)
from groupflow.model.errors import (
    ArgumentError,
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    TeacherUntrained,
)

log = logging.getLogger("groupflow.trainer")

TEACHER_CONFIG = LMConfig(
    vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_len=PROMPT_LENGTH + ANSWER_LENGTH
)
"""The domain teachers' shape: the task's vocabulary, one prompt and its answer long."""

ENGINE_TEACHER_CONFIG = LlamaLMConfig(
    vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_len=ENGINE_CONTEXT
)
"""The same, in the Llama architecture an inference engine serves (`--engine vllm`), with
room for the token a scoring call asks for after the row."""

TARGET_ACCURACY = 0.98
"""Greedy accuracy on held-out prompts a domain teacher must reach to be kept."""

HELD_OUT_SEED = 1_000_003
"""`make_prompts` seed of the held-out prompts (the trainer's runs use small seeds)."""


@attrs.frozen
class TeacherRecipe:
    """How a domain teacher is trained; every field is part of its cache key."""

    config: LMConfig | LlamaLMConfig = TEACHER_CONFIG
    """The model's shape; its type says the architecture."""
    seed: int = 0
    batch_size: int = 128
    learning_rate: float = 3e-3
    max_steps: int = 3000
    eval_every: int = 50
    eval_prompts: int = 512
    train_pool: int = 8192
    """Training prompts drawn once, then sampled in batches."""
    target_accuracy: float = TARGET_ACCURACY


DEFAULT_RECIPE = TeacherRecipe()
ENGINE_RECIPE = TeacherRecipe(config=ENGINE_TEACHER_CONFIG)
"""The teachers of a run on an inference engine."""


@attrs.frozen
class Trained:
    """A teacher fresh from training, with what the cache manifest and the progress line
    report about it."""

    teacher: TorchTeacher
    accuracy: float
    steps: int
    seconds: float


def _task(domain: str) -> Domain:
    task = DOMAINS.get(domain)
    if task is None:
        raise ArgumentError(f"domain {domain!r} is not one of {sorted(DOMAINS)}")
    return task


def held_out_prompts(domain: str, recipe: TeacherRecipe = DEFAULT_RECIPE) -> list[Prompt]:
    """The prompts a teacher is measured on: drawn apart from its training (for `count`, whose
    22 prompts are all seen in training, "held out" can only mean drawn independently)."""
    return make_prompts(recipe.eval_prompts, domains=[domain], seed=HELD_OUT_SEED)


def cache_key(domain: str, recipe: TeacherRecipe = DEFAULT_RECIPE) -> dict[str, Any]:
    """Everything that makes a teacher: the domain, the task's version and a digest of its
    held-out prompts and answers (a changed task definition changes it), the recipe (the
    model's shape and seed included)."""
    sample = [[p.tokens, p.answer] for p in held_out_prompts(domain, recipe)]
    return {
        "domain": domain,
        "task_version": TASK_VERSION,
        "task_sample": _teacher_cache.digest(_teacher_cache.canonical({"sample": sample})),
        "recipe": attrs.asdict(recipe),
    }


def train_domain_teacher(
    domain: str,
    recipe: TeacherRecipe = DEFAULT_RECIPE,
    *,
    device: str = "auto",
    on_progress: Callable[[str], None] | None = None,
) -> Trained:
    """Train a teacher for `domain` until it reaches `recipe.target_accuracy` on held-out
    prompts, checked every `eval_every` steps; `TeacherUntrained` if `max_steps` pass first.
    Deterministic for a recipe and device: the weights come from `recipe.seed`, the data from a
    generator seeded from it, and the global RNG is left as it was."""
    task = _task(domain)
    started = time.perf_counter()
    teacher = TorchTeacher.from_config(recipe.config, seed=recipe.seed, device=device)
    model = teacher.model.train()
    g = torch.Generator().manual_seed(recipe.seed)
    numbers = torch.randint(0, 2**31 - 1, (recipe.train_pool,), generator=g).tolist()
    pool = [task.prompt(i, n) for i, n in enumerate(numbers)]
    sequences = torch.tensor([(*p.tokens, *p.answer) for p in pool], device=teacher.device)
    held_out = held_out_prompts(domain, recipe)
    optimiser = torch.optim.Adam(model.parameters(), lr=recipe.learning_rate)
    accuracy = 0.0
    for step in range(1, recipe.max_steps + 1):
        pick = torch.randint(0, len(pool), (recipe.batch_size,), generator=g)
        batch = sequences[pick.to(teacher.device)]
        logits = model(batch[:, :-1])[:, PROMPT_LENGTH - 1 :]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, PROMPT_LENGTH:].ravel()
        )
        optimiser.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        optimiser.step()
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            accuracy = greedy_accuracy(model, task, held_out)
            if on_progress is not None:
                on_progress(
                    f"teacher {domain}: step {step}, loss {loss.item():.4f}, "
                    f"held-out accuracy {accuracy:.3f}"
                )
            if accuracy >= recipe.target_accuracy:
                model.eval()
                return Trained(teacher, accuracy, step, time.perf_counter() - started)
    raise TeacherUntrained(
        f"the {domain!r} teacher reached held-out accuracy {accuracy:.3f} after "
        f"{recipe.max_steps} steps, short of {recipe.target_accuracy} (recipe {recipe})"
    )


def domain_teacher(
    domain: str,
    *,
    cache_dir: Path | None = None,
    device: str = "auto",
    on_progress: Callable[[str], None] | None = None,
    recipe: TeacherRecipe = DEFAULT_RECIPE,
) -> TorchTeacher:
    """The teacher for `domain`: from the cache (`cache_dir`, by default `$GROUPFLOW_CACHE`,
    else `$XDG_CACHE_HOME/groupflow`, else `~/.cache/groupflow`) when a verified one is there,
    else trained (`train_domain_teacher`) and cached. A damaged or mismatched cache file is
    rebuilt, with a warning naming it."""
    _task(domain)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = _teacher_cache.CacheEntry.of(directory, domain, cache_key(domain, recipe))
    say = on_progress or (lambda _: None)
    try:
        teacher, manifest = _teacher_cache.load(entry, config=recipe.config, device=device)
    except CheckpointNotFound:
        say(f"teacher {domain}: none cached at {entry.weights}; training one")
    except (CheckpointCorrupt, CheckpointMismatch) as exc:
        log.warning("rebuilding the cached %r teacher %s: %s", domain, entry.weights, exc)
        say(f"teacher {domain}: cached file {entry.weights} unusable ({exc}); training again")
    else:
        accuracy = manifest.get("accuracy")
        say(f"teacher {domain}: loaded {entry.weights} (held-out accuracy {accuracy})")
        return teacher
    trained = train_domain_teacher(domain, recipe, device=device, on_progress=on_progress)
    _teacher_cache.save(entry, trained.teacher, accuracy=trained.accuracy, steps=trained.steps)
    say(
        f"teacher {domain}: trained to held-out accuracy {trained.accuracy:.3f} in "
        f"{trained.steps} steps ({trained.seconds:.1f} s); cached at {entry.weights}"
    )
    return trained.teacher
