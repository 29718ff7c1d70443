"""The student: a small causal LM, how it samples a response, and the log-probs of a response
under it (with gradients, for the loss; without, for sampling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from groupflow.impl._teachers._served_lm import GPT2LMConfig
from groupflow.impl._teachers._torch import AnyLM, LMConfig, new_lm
from groupflow.impl._trainer._config import SERVED_HEAD_DIM, Engine, TrainConfig
from groupflow.impl._trainer._tasks import ANSWER_LENGTH, PROMPT_LENGTH, VOCAB

SEQUENCE_LENGTH = PROMPT_LENGTH + ANSWER_LENGTH
ENGINE_CONTEXT = SEQUENCE_LENGTH + 1
"""The context of a model an engine serves: a scoring call sends a whole row and asks for one
token after it (an engine refuses a request with no room for that token)."""


def student_config(
    *, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, served: bool = False
) -> LMConfig | GPT2LMConfig:
    """The student's shape; `served`, in an architecture inference engines serve: GPT-2
    (`GPT2LM`), with heads of `SERVED_HEAD_DIM`. Not a Llama: the `reverse` task asks for the
    token `2j` places back at answer position `j`, which learned absolute positions give at
    once and rotary ones only through a count of the tokens before; trained by on-policy
    distillation, a Llama student of this size learns `count` and never `reverse` (measured,
    with the same teachers, in this process as on vLLM)."""
    if served:
        return GPT2LMConfig(
            vocab_size=VOCAB,
            d_model=d_model,
            n_heads=d_model // SERVED_HEAD_DIM,
            n_layers=n_layers,
            max_len=ENGINE_CONTEXT,
        )
    return LMConfig(
        vocab_size=VOCAB,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        max_len=SEQUENCE_LENGTH,
    )


def new_student(cfg: LMConfig | GPT2LMConfig, *, seed: int) -> AnyLM:
    """A student with fresh weights drawn from `seed` (the global RNG is left as it was)."""
    return new_lm(cfg, seed=seed)


def run_student(config: TrainConfig) -> AnyLM:
    """The student a run of `config` starts from: its shape, its architecture (`GPT2LM` for
    an engine), weights drawn from its seed."""
    shape = student_config(
        d_model=config.d_model,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        served=config.engine is Engine.VLLM,
    )
    return new_student(shape, seed=config.seed)


def response_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs `[rows, ANSWER_LENGTH]` of each response token of `ids` `[rows,
    SEQUENCE_LENGTH]` under `model`: log_softmax of the logits at each position, taken at the
    next token. Keeps gradients when the caller does."""
    logits = model(ids).float()
    logp = torch.log_softmax(logits[:, PROMPT_LENGTH - 1 : -1], dim=-1)
    return logp.gather(-1, ids[:, PROMPT_LENGTH:, None])[..., 0]


@torch.inference_mode()
def sample(
    model: torch.nn.Module,
    prompt: Sequence[int],
    n: int,
    *,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> tuple[list[list[int]], list[list[float]]]:
    """`n` responses of ANSWER_LENGTH tokens to `prompt`, sampled one token at a time, and the
    log-prob of each token under the sampling distribution (the generation log-probs)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)] * n, dtype=torch.long, device=device)
    picked: list[torch.Tensor] = []
    for _ in range(ANSWER_LENGTH):
        logits = model(ids)[:, -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(device)
        picked.append(logp.gather(-1, token)[:, 0])
        ids = torch.cat([ids, token], dim=1)
    responses = ids[:, PROMPT_LENGTH:].cpu().tolist()
    logprobs = torch.stack(picked, dim=1).cpu().tolist()
    return responses, logprobs
