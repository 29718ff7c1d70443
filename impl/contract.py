"""The contract between groupflow and the parts a user brings: the protocols a generator
(`Generator`), a learner (`Learner`, or `StatelessLearner` for one with no state to checkpoint),
a scorer for the teacher stage (`Scorer`) and a teacher scored in DP shards (`Teacher`)
implement, and the values they are handed: `GenerateRequest`, `TrainBatch`, `ScoreRequest`,
`TokenRow`, and `GroupView` (a group as a part sees it). `TEACHER_FIELD` is the field the teacher
stage writes and a distilling learner reads.

One module, so that a user writing a part reads one page, and so that the pumps, the
checkpointer and the teacher backends all depend on it rather than on each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from groupflow.impl._core import SampleStore
from groupflow.model import GroupView

TEACHER_FIELD = "teacher_reference_logprobs"
"""The field the teacher stage writes for every row: the teacher's log-probability of each
response token. A learner that distils reads it."""


@attrs.frozen
class GenerateRequest:
    """One rollout asked of the `Generator`: prompt `ordinal` of the data (`prompt`, its
    `agent`), `num_generations` rows wanted, sampled with weights `weight_version`."""

    ordinal: int
    prompt: Any
    agent: str | None
    num_generations: int
    weight_version: int


class Generator(Protocol):
    """Generates the rows of one prompt's group, and loads new weights when told.

    `generate` returns `request.num_generations` mappings of fields, one per generation, each
    with every field the learner (`train_fields`) and the scorer (`reads`) read; a group that
    does not is a failed rollout naming the field. An optional `fields` attribute (the names
    it writes) lets `build_pipeline` check that before anything runs, and is the default
    `train_fields`. `sync_weights(version)` is awaited after every train step, before rollouts
    are labelled with `version`; make it a no-op if the weights never change.

    Example, a torch policy sampled in a worker thread::

        class MyGenerator:
            fields = frozenset({"input_ids", "prompt_length", "generation_logprobs"})

            def __init__(self, policy, learner):
                self.policy, self.learner = policy, learner

            async def generate(self, request: GenerateRequest) -> list[dict]:
                return await trio.to_thread.run_sync(
                    sample, self.policy, request.prompt, request.num_generations
                )

            async def sync_weights(self, version: int) -> None:
                self.policy.load_state_dict(self.learner.model.state_dict())
    """

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        """The rows of `request.prompt`'s group (`request.num_generations` of them)."""
        ...

    async def sync_weights(self, version: int) -> None:
        """The learner's weights are now `version`: load them before the next rollouts."""
        ...


@attrs.frozen
class TrainBatch:
    """One train step's groups and their rows: never empty (a step whose prompts were all
    given up is skipped, and the learner is not called)."""

    step: int
    weight_version: int
    groups: tuple[GroupView, ...]
    rows: Mapping[str, Mapping[str, Any]]
    """Fields by sample id (`train_fields` and the teacher's field), for every row of `groups`."""
    given_up: tuple[int, ...] = ()
    """Ordinals of the step's prompts that were given up (a failed rollout or teacher call)."""


class StatelessLearner(Protocol):
    """A learner that keeps no state a checkpoint must save: say so with
    `build_pipeline(..., stateless_learner=True)`."""

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        """One optimisation step on `batch`; returns the step's statistics (floats by name)."""
        ...


class Learner(StatelessLearner, Protocol):
    """Takes one optimisation step on a batch; its state (weights, optimizer) is saved with
    every checkpoint and restored on resume.

    Example, a torch learner::

        class MyLearner:
            def __init__(self, model, lr=1e-3):
                self.model = model
                self.opt = torch.optim.Adam(model.parameters(), lr=lr)

            async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
                loss = my_loss(self.model, [batch.rows[sid] for g in batch.groups
                                            for sid in g.sample_ids])
                self.opt.zero_grad(); loss.backward(); self.opt.step()
                return {"loss": loss.item()}

            def state_dict(self) -> dict:
                return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

            def load_state_dict(self, state: dict) -> None:
                self.model.load_state_dict(state["model"]); self.opt.load_state_dict(state["opt"])
    """

    def state_dict(self) -> Any:
        """Everything a resume needs to continue training (picklable)."""
        ...

    def load_state_dict(self, state: Any) -> None | Awaitable[None]:
        """Restore what `state_dict` returned. (An asyncio learner's, wrapped in
        `groupflow.impl.aio.part`, may be `async def`, and its `state_dict` too.)"""
        ...


@attrs.frozen
class ScoreRequest:
    """One teacher call: the groups of a batch, the physical teacher, where the rows live."""

    teacher: str
    groups: tuple[GroupView, ...]
    store: SampleStore
    field: str
    """The field the call must write for every row of every group."""
    abandon_after_s: float = 60.0
    """How long a cancelled call may take to return before a `ThreadedScorer` abandons its
    thread (the pipeline sets `shutdown_timeout_s`)."""

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(sid for g in self.groups for sid in g.sample_ids)


@runtime_checkable
class Scorer(Protocol):
    """Writes `request.field` for every row of the request into `request.store`, or raises
    (writing nothing that stays: a failed call must leave no partial field).

    Two optional attributes let `build_pipeline` check the wiring before anything runs:
    `teachers`, the physical teacher names it serves (a collection, or a mapping keyed by
    them), against which every route is checked; and `reads`, the row fields it reads, which
    the generator must write. Without them, a route to a missing teacher fails at its first
    call.

    Example, a scorer that asks a remote service::

        class RemoteScorer:
            teachers = frozenset({"math-7b", "code-7b"})
            reads = frozenset({"input_ids", "prompt_length"})

            async def score(self, request: ScoreRequest) -> None:
                rows = request.store.get(request.sample_ids, sorted(self.reads))
                logprobs = await my_client.score(request.teacher, rows)  # with a timeout
                request.store.add_fields({sid: {request.field: logprobs[sid]} for sid in rows})
    """

    async def score(self, request: ScoreRequest) -> None: ...


@attrs.frozen
class TokenRow:
    """What a teacher scores: a sequence and where its response starts."""

    input_ids: tuple[int, ...]
    prompt_length: int

    @property
    def response_length(self) -> int:
        return len(self.input_ids) - self.prompt_length


@runtime_checkable
class Teacher(Protocol):
    """A model that returns, per row, the log-probability of each response token.

    `score_teacher_batch` pads a batch to a multiple of `dp_size` and hands one shard per rank;
    what comes back is checked (one finite value per response token). `TorchTeacher` and
    `HFTeacher` are teachers; wrap teachers by name in `TeacherScorer` for the stage.

    Example, a teacher behind your own inference server::

        class ServedTeacher:
            dp_size = 4  # the server's data-parallel ranks

            def score_shards(self, shards):
                return [client.logprobs(rank, [r.input_ids for r in shard],
                                        [r.prompt_length for r in shard], timeout=30)
                        for rank, shard in enumerate(shards)]
    """

    @property
    def dp_size(self) -> int: ...

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        """One shard per DP rank; per shard, per row, `response_length` log-probs."""
        ...


__all__ = [
    "TEACHER_FIELD",
    "GenerateRequest",
    "Generator",
    "GroupView",
    "Learner",
    "ScoreRequest",
    "Scorer",
    "StatelessLearner",
    "Teacher",
    "TokenRow",
    "TrainBatch",
]
