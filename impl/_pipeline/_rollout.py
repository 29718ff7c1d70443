"""The rollout pump (a PRODUCER): admits prompts in order and generates their groups.

A prompt is admitted when a generation permit is free (`max_inflight_prompts`), the buffer has
room (unready groups count), and its train step is at most `gate_window` steps ahead of training.
Its slot is reserved at admission, so capacity can never be over-drawn. With the pump design the
permit is released at commit, before the group is handed to the stage; with the inline baseline
it is held until the group is scored.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl._core import PromptLedger, Pulse, ReplayBuffer, Row
from groupflow.impl._pipeline._config import PipelineConfig
from groupflow.impl._pipeline._inline_baseline import InlineScoring
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._part_checks import check_generations, tokens_of
from groupflow.impl._pipeline._pump import PumpKind, single_error
from groupflow.impl._pipeline._scoring_stage import ScoringStage
from groupflow.impl.contract import GenerateRequest, Generator
from groupflow.model import Actor, GroupState, decisions
from groupflow.model.errors import ArgumentError, RolloutsFailed, RoutingError
from groupflow.model.scheduler import Phase
from groupflow.model.scheduler.actions import ActionKind

log = logging.getLogger("groupflow.rollout")


@attrs.define
class TrainPosition:
    """Where training is: read by the rollout pump (gate, weight versions), moved by the train pump."""

    step: int = 0
    weight_version: int = 0
    changed: Pulse = attrs.field(factory=Pulse)
    """Notified when training moves on; the controller shares the buffer's pulse here, so the
    rollout pump waits on one pulse for room in the buffer and for the gate to open."""
    loading: int | None = None
    """The weight version a sync is loading into the generator, from the sync's start until
    training moves on: a rollout that ends meanwhile may have been sampled with it."""

    @property
    def newest_weights(self) -> int:
        """The newest weight version a rollout ending now may have been sampled with: its
        group's end weight version."""
        return self.weight_version if self.loading is None else self.loading

    def advance(self) -> None:
        """One train step done: new weights, and the gate moves one step."""
        self.weight_version += 1
        self.loading = None
        self.step += 1
        self.changed.notify()


class RolloutPump:
    kind = PumpKind.PRODUCER

    def __init__(
        self,
        buffer: ReplayBuffer,
        ledger: PromptLedger,
        generator: Generator,
        *,
        config: PipelineConfig,
        position: TrainPosition,
        prompts: Sequence[Any],
        status: RunStatus | None = None,
        agent_of: Callable[[int], str | None] = lambda ordinal: None,
        stage: ScoringStage | None = None,
        inline: InlineScoring | None = None,
        row_fields: frozenset[str] = frozenset(),
        name: str = "rollout",
    ) -> None:
        if stage is not None and inline is not None:
            raise ArgumentError("a rollout pump hands groups to a stage or scores inline, not both")
        self.name = name
        self.buffer = buffer
        self.ledger = ledger
        self.generator = generator
        self.config = config
        self.position = position
        self.prompts = prompts
        self.status = status if status is not None else RunStatus()
        self.agent_of = agent_of
        self.stage = stage
        self.inline = inline
        self.row_fields = row_fields
        """Fields every generated row must have (what the learner and the scorer read)."""
        self.commits = 0
        self.failures = 0
        self.failed_in_a_row = 0
        """Rollouts failed since the last commit (`max_consecutive_failed_rollouts`)."""
        self.holding: set[int] = set()
        """Ordinals whose rollout holds a generation permit (`max_inflight_prompts` at most)."""
        self._incarnations = itertools.count()
        """Numbers each group this pump reserves, so a prompt issued again gets a fresh id."""
        self.permit_seconds_scoring = 0.0
        """Generation permits held while groups were scored, summed over time: zero in the
        pump design, where the permit is free at commit."""

    @property
    def free_permits(self) -> int:
        return self.config.shape.max_inflight_prompts - len(self.holding)

    async def run(self) -> None:
        with single_error():
            async with trio.open_nursery() as nursery:
                while True:
                    admitted = await self._admit()
                    if admitted is None:
                        break
                    nursery.start_soon(self._rollout, *admitted)

    def target_step(self, ordinal: int) -> int:
        return ordinal // self.config.shape.prompts_per_step

    async def _admit(self) -> tuple[int, str] | None:
        """Wait for a permit, room and the gate (`decisions.admission`); reserve the next
        prompt's slot and take its permit. None: no prompt is left."""
        while True:
            ordinal = self.ledger.peek()
            if ordinal is None:
                return None
            hold = decisions.admission(
                running=self.status.phase is Phase.RUNNING,
                free_permits=self.free_permits,
                held_groups=len(self.buffer),
                max_buffered_groups=self.config.shape.max_buffered_groups,
                steps_ahead=self.target_step(ordinal) - self.position.step,
                gate_window=self.config.shape.gate_window,
            )
            if hold is None:
                self.ledger.issue()
                gid = self.buffer.reserve(
                    target_step=self.target_step(ordinal),
                    ordinal=ordinal,
                    agent=self.agent_of(ordinal),
                    group_id=f"p{ordinal}-{next(self._incarnations)}",
                    actor=Actor.ROLLOUT,
                )
                self.holding.add(ordinal)
                self.status.report(ActionKind.ADMIT, ordinal=ordinal, group=gid)
                return ordinal, gid
            await self.buffer.changed.wait()

    def _release(self, ordinal: int) -> None:
        if ordinal in self.holding:
            self.holding.discard(ordinal)
            self.buffer.changed.notify()

    async def _rollout(self, ordinal: int, gid: str) -> None:
        try:
            try:
                scorer = self.stage if self.stage is not None else self.inline
                if scorer is not None:
                    scorer.teacher_for(self.buffer.group(gid))  # no teacher: fail early
                tokens = await self._generate_and_commit(ordinal, gid)
            except BaseException as exc:
                with trio.CancelScope(shield=True):
                    if self.buffer.state_of(gid) is GroupState.RESERVED:
                        await self.buffer.discard(gid, actor=Actor.ROLLOUT)
                # the discard, the ledger, the permit and the run's one failure decision change
                # in one synchronous block
                judged = isinstance(exc, Exception) and decisions.failure_is_judged(
                    run_failed=self.status.failed
                )
                if judged and isinstance(exc, RoutingError) and self.status.claim_failure():
                    self.status.fail()  # no teacher for its agent: the run fails, cleanly
                    self._cancelled(ordinal, gid)
                    raise
                if judged:
                    self.failures += 1
                    log.warning("rollout of prompt %d failed, given up: %r", ordinal, exc)
                    self.ledger.mark_shortfall(ordinal)
                    self._release(ordinal)
                    self.status.report(ActionKind.ROLLOUT_FAIL, ordinal=ordinal, group=gid)
                    self.failed_in_a_row += 1
                    limit = self.config.max_consecutive_failed_rollouts
                    if self.failed_in_a_row > limit and self.status.claim_failure():
                        self.status.fail()  # first: the other rollouts' cancels are shutdown
                        raise RolloutsFailed(
                            f"generator: {self.failed_in_a_row} rollouts in a row failed "
                            f"(max_consecutive_failed_rollouts={limit}); last, prompt "
                            f"{ordinal}: {exc!r}"
                        ) from exc
                    return
                self._cancelled(ordinal, gid)
                if isinstance(exc, Exception):
                    return  # the run has failed for another reason: this rollout is cancelled
                raise
            self.commits += 1
            self.failed_in_a_row = 0
            if self.inline is not None:  # the baseline: the permit is held while scoring
                self.inline.enqueue(gid)
                self.status.report(ActionKind.COMMIT, ordinal=ordinal, group=gid, tokens=tokens)
                started = trio.current_time()
                try:
                    await self.inline.score(gid, release=lambda: self._release(ordinal))
                finally:
                    self.permit_seconds_scoring += trio.current_time() - started
                return
            self._release(ordinal)  # the pump: the permit is free before the group is scored
            if self.stage is not None:
                self.stage.submit(gid)
            self.status.report(ActionKind.COMMIT, ordinal=ordinal, group=gid, tokens=tokens)
        finally:
            self._release(ordinal)

    def _cancelled(self, ordinal: int, gid: str) -> None:
        """A rollout ended by the run's shutdown: its prompt is issued again on resume."""
        self.ledger.mark_dropped(ordinal)
        self._release(ordinal)
        self.status.report(ActionKind.CANCEL, ordinal=ordinal, group=gid)

    async def _generate_and_commit(self, ordinal: int, gid: str) -> int | None:
        """Generate prompt `ordinal`'s group and commit its rows; the group's tokens
        (`tokens_of`)."""
        start_version = self.position.weight_version
        request = GenerateRequest(
            ordinal=ordinal,
            prompt=self.prompts[ordinal],
            agent=self.agent_of(ordinal),
            num_generations=self.config.shape.num_generations_per_prompt,
            weight_version=start_version,
        )
        generations = check_generations(
            ordinal,
            await self.generator.generate(request),
            expected=self.config.shape.num_generations_per_prompt,
            needs=self.row_fields,
        )
        tokens = tokens_of(generations)
        rows = [Row(f"{gid}/{i}", fields) for i, fields in enumerate(generations)]
        await self.buffer.commit(
            gid,
            rows,
            start_weight_version=start_version,
            end_weight_version=self.position.newest_weights,
            defer_ready=self.stage is not None or self.inline is not None,
            actor=Actor.ROLLOUT,
        )
        return tokens
