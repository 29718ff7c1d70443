"""The trainer's optional second stage: a verifier that checks every sampled response against
its prompt's verifiable answer and writes the row's reward (1.0 right, 0.0 wrong).

It runs as an `ExtraStage` after the teacher's, so a group is READY only once both its teacher
log-probabilities and its rewards are in the store (the two-stage case the model checks). It is
a rule, not a model: cheap enough to run in the trio thread, one store read and one write per
call.
"""

from __future__ import annotations

from collections.abc import Sequence

from groupflow.impl._pipeline import ExtraStage
from groupflow.impl._trainer._tasks import PROMPT_LENGTH, Prompt, domain_of
from groupflow.impl.contract import ScoreRequest

VERIFIER = "verifier"
"""The stage's name: its queue, its lane in the trace, its metrics in `metrics.jsonl`."""
REWARD_FIELD = "verifier_reward"
"""The row field the verifier writes."""


class Verifier:
    """A `Scorer` for the verifier stage (see the module docstring)."""

    teachers = frozenset({VERIFIER})
    reads = frozenset({"input_ids"})

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self.prompts = prompts

    async def score(self, request: ScoreRequest) -> None:
        rows = request.store.get(request.sample_ids, ["input_ids"])
        rewards = {}
        for group in request.groups:
            if group.ordinal is None:
                raise ValueError(f"group {group.group_id!r} has no prompt ordinal to verify")
            prompt = self.prompts[group.ordinal]
            domain = domain_of(prompt)
            for sid in group.sample_ids:
                response = list(rows[sid]["input_ids"])[PROMPT_LENGTH:]
                rewards[sid] = {request.field: 1.0 if domain.correct(prompt, response) else 0.0}
        request.store.add_fields(rewards)


def verifier_stage(prompts: Sequence[Prompt]) -> ExtraStage:
    """The stage `build_pipeline(extra_stages=...)` takes."""
    return ExtraStage(VERIFIER, Verifier(prompts), REWARD_FIELD)
