"""The pipeline's `Generator` for the student: samples rollouts in a worker thread from its own
copy of the student, and takes the learner's weights by version after each step (the refit)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import trio

from groupflow.impl._trainer._student import sample
from groupflow.impl._trainer._tasks import PROMPT_LENGTH, Prompt
from groupflow.impl.contract import GenerateRequest
from groupflow.model.errors import ArgumentError

ROW_FIELDS = frozenset({"input_ids", "prompt_length", "generation_logprobs", "weight_version"})


class StudentGenerator:
    """Samples `num_generations` responses per prompt from the weights of version
    `weight_version`, each row recording that version.

    Sampling runs in a worker thread (`trio.to_thread.run_sync`), so the trio loop goes on
    while a rollout computes; a lock keeps a refit from changing the weights under a thread
    that is sampling. `weights` gives the learner's current weights (its `state_dict`)."""

    fields = ROW_FIELDS

    def __init__(
        self,
        model: torch.nn.Module,
        weights: Callable[[], Mapping[str, torch.Tensor]],
        *,
        seed: int,
        temperature: float = 1.0,
    ) -> None:
        self.model = copy.deepcopy(model).eval()
        self._weights = weights
        self._seed = seed
        self.temperature = temperature
        self.version = 0
        self.syncs = 0
        self._lock = threading.Lock()

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        prompt = request.prompt
        if not isinstance(prompt, Prompt):
            raise ArgumentError(f"StudentGenerator samples trainer Prompts, got {prompt!r}")
        return await trio.to_thread.run_sync(self._rollout, prompt, request.num_generations)

    def _rollout(self, prompt: Prompt, n: int) -> list[dict[str, Any]]:
        rng = torch.Generator().manual_seed(self._seed * 1_000_003 + prompt.ordinal)
        with self._lock:
            version = self.version
            responses, logprobs = sample(
                self.model, prompt.tokens, n, generator=rng, temperature=self.temperature
            )
        return [
            {
                "input_ids": [*prompt.tokens, *response],
                "prompt_length": PROMPT_LENGTH,
                "generation_logprobs": lp,
                "weight_version": version,
            }
            for response, lp in zip(responses, logprobs, strict=True)
        ]

    async def sync_weights(self, version: int) -> None:
        """Copy the learner's weights (the refit) and take their version."""
        weights = {k: v.detach().clone() for k, v in self._weights().items()}
        await trio.to_thread.run_sync(self._load, weights, version)

    def _load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(weights)
            self.version = version
            self.syncs += 1
