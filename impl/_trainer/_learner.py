"""The pipeline's `Learner` for on-policy distillation, and the loss it minimises.

Per response token, the advantage is `A_t = teacher_logprob_t - generation_logprob_t` (no
gradient flows through it): positive where the teacher likes the sampled token more than the
student that sampled it. The loss is `-mean(w_t * A_t * log pi_theta(y_t))`, where the
importance weight `w_t = exp(prev_logprob_t - generation_logprob_t)`, truncated to
`[clip_low, clip_high]`, corrects for the rollout having been sampled by older weights than
the ones trained (`prev_logprob_t`: the current weights, before this step's update).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import trio

from groupflow.impl._trainer._student import response_logprobs
from groupflow.impl._trainer._tasks import PROMPT_LENGTH, Prompt, domain_of
from groupflow.impl._trainer._verifier import REWARD_FIELD
from groupflow.impl.contract import TEACHER_FIELD, TrainBatch
from groupflow.model.errors import LearnerDiverged

TRAIN_FIELDS = ("input_ids", "generation_logprobs", "weight_version")


@attrs.frozen
class LossParts:
    loss: torch.Tensor
    advantage: torch.Tensor
    weight: torch.Tensor
    """The truncated importance weights."""
    clipped: float
    """The share of weights the truncation changed."""


def distill_loss(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    reward: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> LossParts:
    """The truncated importance-weighted distillation loss over `[rows, tokens]` tensors:
    `logprobs` under the weights being trained (with gradients), the others as recorded.
    `reward` (`[rows]`), times `reward_weight`, is added to every token's advantage."""
    advantage = (teacher_logprobs - generation_logprobs).detach()
    if reward is not None and reward_weight:
        advantage = advantage + reward_weight * reward.detach()[:, None]
    raw = torch.exp(logprobs.detach() - generation_logprobs)
    weight = raw.clamp(clip_low, clip_high)
    clipped = float((raw != weight).float().mean())
    loss = -(weight * advantage * logprobs).mean()
    return LossParts(loss, advantage, weight, clipped)


def _refuse_divergence(loss: float, step: int, lr: float) -> None:
    """A loss that is not a finite number fails the step before it touches the weights."""
    if not math.isfinite(loss):
        raise LearnerDiverged(
            f"the loss of train step {step} is {loss}: the student diverged (this step is not "
            f"taken; the steps before it overshot); start a run with a smaller [train] lr "
            f"than {lr:g}"
        )


class DistillLearner:
    """One Adam step per train batch on the distillation loss; its state (weights, optimizer)
    is what a checkpoint saves. Reports the loss, the teacher-student KL on the sampled tokens
    (`generation_logprob - teacher_logprob`, averaged: an estimate of KL(student || teacher)),
    and each domain's share of correct rollouts. With `reward_weight > 0` the rows carry the
    verifier stage's reward (`REWARD_FIELD`), which joins the advantage."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Prompt],
        *,
        lr: float,
        clip_low: float,
        clip_high: float,
        reward_weight: float = 0.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model.to(device).train()
        self.device = torch.device(device)
        self.prompts = prompts
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.reward_weight = reward_weight
        self.steps = 0

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        """The step computes in a worker thread, off the event loop's (under the asyncio host,
        the trainer's loop goes on meanwhile); a cancel waits for it to end, never leaving the
        weights half updated."""
        return await trio.to_thread.run_sync(self._train_step, batch)

    def _train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        ids, generation, teacher, correct, domains, rewards = [], [], [], [], [], []
        for group in batch.groups:
            assert group.ordinal is not None
            prompt = self.prompts[group.ordinal]
            domain = domain_of(prompt)
            for sid in group.sample_ids:
                row = batch.rows[sid]
                ids.append(list(row["input_ids"]))
                generation.append(list(row["generation_logprobs"]))
                teacher.append(list(row[TEACHER_FIELD]))
                correct.append(domain.correct(prompt, row["input_ids"][PROMPT_LENGTH:]))
                domains.append(prompt.domain)
                if self.reward_weight:
                    rewards.append(float(row[REWARD_FIELD]))
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        gen_t = torch.tensor(generation, dtype=torch.float32, device=self.device)
        teacher_t = torch.tensor(teacher, dtype=torch.float32, device=self.device)
        reward = (
            torch.tensor(rewards, dtype=torch.float32, device=self.device)
            if self.reward_weight
            else None
        )
        parts = distill_loss(
            response_logprobs(self.model, ids_t),
            gen_t,
            teacher_t,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            reward=reward,
            reward_weight=self.reward_weight,
        )
        loss = float(parts.loss.detach())
        _refuse_divergence(loss, self.steps, self.optimizer.param_groups[0]["lr"])
        self.optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.steps += 1
        stats: dict[str, float] = {
            "loss": loss,
            "kl": float((gen_t - teacher_t).mean()),
            "advantage": float(parts.advantage.mean()),
            "clipped": parts.clipped,
            "rows": float(len(ids)),
        }
        if reward is not None:
            stats["reward"] = float(reward.mean())
        by_domain: dict[str, list[bool]] = defaultdict(list)
        for domain_name, ok in zip(domains, correct, strict=True):
            by_domain[domain_name].append(ok)
        for domain_name, oks in sorted(by_domain.items()):
            stats[f"accuracy/{domain_name}"] = sum(oks) / len(oks)
        return stats

    def weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
