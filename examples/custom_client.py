"""A complete client of groupflow's pipeline: your own student, generator and learner, two
torch teachers routed by domain, on-policy distillation, a checkpoint, a crash and a resume.

Run it: `python examples/custom_client.py [RUN_DIR]` (a temporary folder by default). It
prints one line per phase and checks, at the end, that every prompt was trained exactly once
across the crash. CI runs it (tests/meta/test_examples.py), and the README quotes it.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import trio
from torch import nn

# --8<-- [start:imports]
from groupflow.impl import (
    TEACHER_FIELD,
    CheckpointConfig,
    GenerateRequest,
    LMConfig,
    PipelineConfig,
    ScoringConfig,
    Shape,
    TeacherScorer,
    ThreadedScorer,
    TorchTeacher,
    TrainBatch,
    build_pipeline,
    load_checkpoint,
    teacher_by_agent,
)

# --8<-- [end:imports]

VOCAB = 32
RESPONSE = 6
"""Tokens generated per response."""


# --8<-- [start:data]
def make_prompts(n: int) -> list[dict[str, Any]]:
    """Two domains: continue a count, or reverse a short sequence. Prompt `o` is ordinal `o`."""
    prompts = []
    for o in range(n):
        start = 1 + o % 20
        if o % 2 == 0:
            prompts.append({"domain": "count", "tokens": [start, start + 1, start + 2]})
        else:
            prompts.append({"domain": "reverse", "tokens": [start + 2, start + 1, start]})
    return prompts


# --8<-- [end:data]


# --8<-- [start:student]
class Student(nn.Module):
    """Your own model: here a tiny bigram language model, in plain torch."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Embedding(VOCAB, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logp: torch.Tensor = torch.log_softmax(self.logits(ids), dim=-1)
        return logp


def response_logprobs(model: Student, ids: list[int], prompt_length: int) -> torch.Tensor:
    """log pi(y_t | y_<t) for each response token of one row."""
    tokens = torch.tensor(ids)
    logp: torch.Tensor = model(tokens[:-1])
    return logp[prompt_length - 1 :].gather(-1, tokens[prompt_length:, None])[:, 0]


# --8<-- [end:student]


# --8<-- [start:generator]
class StudentSampler:
    """The `Generator`: samples from a copy of the student in a worker thread; the copy is
    replaced when the pipeline says new weights exist (`sync_weights`)."""

    fields = frozenset({"input_ids", "prompt_length", "generation_logprobs"})
    """What each row holds: also what the learner reads by default."""

    def __init__(self, learner: Distiller) -> None:
        self.learner = learner
        self.policy = copy.deepcopy(learner.model)
        self.version = 0

    async def generate(self, request: GenerateRequest) -> list[dict[str, Any]]:
        policy = self.policy  # rollouts in flight keep the weights they started with
        return await trio.to_thread.run_sync(self._sample, policy, request)

    def _sample(self, policy: Student, request: GenerateRequest) -> list[dict[str, Any]]:
        prompt = list(request.prompt["tokens"])
        seed = request.ordinal * 1000 + request.weight_version
        rng = torch.Generator().manual_seed(seed)
        rows = []
        with torch.no_grad():
            for _ in range(request.num_generations):
                ids, logprobs = list(prompt), []
                for _ in range(RESPONSE):
                    logp = policy(torch.tensor(ids[-1:]))[0]
                    token = int(torch.multinomial(logp.exp(), 1, generator=rng))
                    ids.append(token)
                    logprobs.append(float(logp[token]))
                rows.append(
                    {
                        "input_ids": ids,
                        "prompt_length": len(prompt),
                        "generation_logprobs": logprobs,
                    }
                )
        return rows

    async def sync_weights(self, version: int) -> None:
        self.policy = copy.deepcopy(self.learner.model)
        self.version = version


# --8<-- [end:generator]


# --8<-- [start:learner]
class Distiller:
    """The `Learner`: on-policy distillation. The advantage of each response token is
    `teacher_logprob - generation_logprob` (no gradient through it), weighted by the
    truncated importance ratio between the current weights and those that sampled it."""

    def __init__(self, lr: float = 0.05) -> None:
        torch.manual_seed(0)
        self.model = Student()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.trained: list[int] = []
        """Ordinals trained by this process (the checkpoint's ledger has the earlier ones)."""

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        return await trio.to_thread.run_sync(self._step, batch)

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        terms, kl = [], []
        for group in batch.groups:
            for sid in group.sample_ids:
                row = batch.rows[sid]
                logp = response_logprobs(self.model, row["input_ids"], row["prompt_length"])
                generated = torch.tensor(row["generation_logprobs"])
                teacher = torch.tensor(row[TEACHER_FIELD])
                advantage = teacher - generated
                weight = torch.exp(logp.detach() - generated).clamp(0.5, 2.0)
                terms.append(-(weight * advantage * logp).mean())
                kl.append(float((generated - teacher).mean()))
        loss = torch.stack(terms).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.trained += [g.ordinal for g in batch.groups if g.ordinal is not None]
        return {"loss": loss.item(), "kl": sum(kl) / len(kl)}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


# --8<-- [end:learner]


# --8<-- [start:pipeline]
TEACHER_SHAPE = LMConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, max_len=64)
TEACHERS = {  # one physical teacher per domain (random weights here; load yours instead)
    "teacher-count": TorchTeacher.from_config(TEACHER_SHAPE, seed=1, device="cpu"),
    "teacher-reverse": TorchTeacher.from_config(TEACHER_SHAPE, seed=2, device="cpu"),
}
PROMPTS = make_prompts(24)


def config(run_dir: Path) -> PipelineConfig:
    return PipelineConfig(
        shape=Shape(
            prompts_per_step=4,
            num_generations_per_prompt=2,
            max_inflight_prompts=4,
            max_buffered_groups=8,
            max_batch_groups=4,
        ),
        scoring=ScoringConfig(flush_after_s=0.05),
        checkpoints=CheckpointConfig(run_dir, every_steps=2),
    )


def build(run_dir: Path) -> tuple[Any, Distiller]:
    learner = Distiller()
    pipeline = build_pipeline(
        config(run_dir),
        prompts=PROMPTS,
        agent_of=lambda ordinal: PROMPTS[ordinal]["domain"],
        route=teacher_by_agent({"count": "teacher-count", "reverse": "teacher-reverse"}),
        generator=StudentSampler(learner),
        learner=learner,
        scorer=ThreadedScorer(TeacherScorer(TEACHERS)),
    )
    return pipeline, learner


# --8<-- [end:pipeline]


# --8<-- [start:crash]
async def crash_after_first_checkpoint(run_dir: Path) -> None:
    """Run until the first checkpoint is on disk, then die at once, mid-run."""
    pipeline, _ = build(run_dir)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.run)
        while not pipeline.checkpointer.saved:
            await pipeline.buffer.changed.wait()  # woken by every change of a group
        nursery.cancel_scope.cancel()  # as if the process were killed


async def resume(run_dir: Path) -> tuple[Any, Distiller, Any]:
    checkpoint = load_checkpoint(run_dir)  # the newest; refuses one of another run
    pipeline, learner = build(run_dir)  # a fresh process builds everything again
    await pipeline.resume_from(checkpoint)
    result = await pipeline.run()
    return checkpoint, learner, result


# --8<-- [end:crash]


async def main(run_dir: Path) -> None:
    with trio.fail_after(120):
        await crash_after_first_checkpoint(run_dir)
    first = load_checkpoint(run_dir)
    print(f"crashed after the checkpoint at step {first.step}: {first.path}")
    with trio.fail_after(120):
        checkpoint, learner, result = await resume(run_dir)
    before = set(checkpoint.ledger["trained"])
    after = learner.trained
    assert len(after) == len(set(after)), "a prompt trained twice after the resume"
    assert not before & set(after), "a prompt trained before the crash was trained again"
    assert before | set(after) == set(range(len(PROMPTS))) - result.shortfall
    last = result.steps[-1]
    print(
        f"resumed from step {checkpoint.step}, trained steps {result.steps[0].step}.."
        f"{last.step}; loss {last.stats['loss']:.3f}, kl {last.stats['kl']:.3f}, "
        f"weight sync {sum(s.sync_s for s in result.steps) * 1e3:.1f} ms in all"
    )
    print(
        f"every prompt trained once: {len(before)} before the crash, {len(after)} after, "
        f"{len(result.shortfall)} given up"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        trio.run(main, Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(main, Path(tmp))
