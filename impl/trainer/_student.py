"""The student: a small causal LM, how it samples a response, and the log-probs of a response
under it (with gradients, for the loss; without, for sampling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from groupflow.impl.teachers import CausalLM, LMConfig
from groupflow.impl.trainer._tasks import ANSWER_LENGTH, PROMPT_LENGTH, VOCAB

SEQUENCE_LENGTH = PROMPT_LENGTH + ANSWER_LENGTH


def student_config(*, d_model: int = 64, n_layers: int = 2, n_heads: int = 4) -> LMConfig:
    return LMConfig(
        vocab_size=VOCAB,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        max_len=SEQUENCE_LENGTH,
    )


def new_student(cfg: LMConfig, *, seed: int) -> CausalLM:
    """A student with fresh weights drawn from `seed` (the global RNG is left as it was)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return CausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)


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
