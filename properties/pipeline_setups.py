"""What one example of the pipeline machine runs: its setup (`Setup`, drawn by `setups`: the
pipeline's config, the teachers and the agents of the prompts) and its incarnations (one
process's pipeline each: the first, and one per resume), with what a completed run's lineage
of incarnations must show (`trained_exactly_once`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs
import trio
from hypothesis import assume
from hypothesis import strategies as st

from groupflow.impl._pipeline import CheckpointConfig, Pipeline, PipelineConfig, ScoringConfig
from groupflow.impl.contract import TrainBatch
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, Dispatch, FailurePolicy
from groupflow.model.shape import Shape
from groupflow.properties.pipeline_doubles import CheckingLearner, HeldGenerator, HeldScorer


@attrs.frozen
class Setup:
    config: PipelineConfig
    steps: int
    teachers: tuple[str, ...]
    agents: tuple[str, ...]
    """The agent of each prompt."""
    dp_sizes: tuple[int, ...]
    """Each teacher's DP size: a batch is padded to a multiple of it."""
    verifier: bool = False
    """A second scoring stage after the teachers' (`ExtraStage`): the two-stage model."""


def without_safety(config: PipelineConfig) -> PipelineConfig:
    """The test-only escape hatch: `config` with its flush timer off (which the config refuses
    to build), so a partial batch waits for a full one or the drain, whatever admission does.
    Only `PipelineMachine(unsafe=True)` uses it, to show the machine finds the deadlock the
    config's conditions prevent."""
    assert config.scoring is not None
    scoring = config.scoring
    object.__setattr__(scoring, "flush_after_s", math.inf)
    return config


@st.composite
def setups(draw: st.DrawFn, *, unsafe: bool = False) -> Setup:
    """A configuration the pipeline accepts (`unsafe`: one past its deadlock conditions, no
    flush timer and no demand dispatch, which only `without_safety` can build)."""
    # every draw is made whatever the others gave (three DP sizes, an agent for each of the
    # most prompts there can be): so when the shrinker makes one smaller, the draws after it
    # still line up with the same choices
    per_step = draw(st.integers(1, 3), label="prompts_per_step")
    permits = draw(st.integers(1, 4), label="permits")
    teachers = tuple(f"t{i}" for i in range(draw(st.integers(1, 3), label="teachers")))
    dp_sizes = tuple(draw(st.integers(1, 3), label=f"dp_size of t{i}") for i in range(3))
    steps = draw(st.integers(2, 4), label="steps")
    agents = tuple(
        f"a{draw(st.integers(0, 2), label=f'agent of prompt {o}') % len(teachers)}"
        for o in range(4 * 3)
    )[: steps * per_step]
    flush = draw(st.sampled_from([0.5, 2.0, 10.0]), label="flush_after_s")
    batch = min(draw(st.integers(1, 4), label="max_batch_groups"), 4 if unsafe else permits)
    scoring = ScoringConfig(
        flush_after_s=flush,
        dispatch=Dispatch.TIMER if unsafe else draw(st.sampled_from(Dispatch), label="dispatch"),
        failure_policy=draw(
            st.sampled_from(
                [
                    FailurePolicy.RETRY,
                    FailurePolicy.RETRY,
                    FailurePolicy.DISCARD,
                    FailurePolicy.FAIL,
                ]
            ),
            label="failure_policy",
        ),
        call_timeout_s=draw(st.sampled_from([30.0, 600.0]), label="call_timeout_s"),
        max_consecutive_failed_batches=1_000_000,
    )
    try:
        config = PipelineConfig(
            shape=Shape(
                prompts_per_step=per_step,
                num_generations_per_prompt=draw(st.integers(1, 2), label="generations"),
                max_inflight_prompts=permits,
                max_buffered_groups=per_step + draw(st.integers(-1, 3), label="capacity over step"),
                gate_window=draw(st.integers(0, 2), label="gate_window"),
                max_batch_groups=batch,
            ),
            scoring=scoring,
            max_consecutive_failed_rollouts=1_000_000,
            stall_timeout_s=draw(st.sampled_from([20.0, 200.0]), label="stall_timeout_s"),
            stall_action="warn",
            # each incarnation gets its own folder when it is built; written inline
            checkpoints=CheckpointConfig(
                ".",
                policy=draw(
                    st.sampled_from([CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED]),
                    label="checkpoint policy",
                ),
                flush_timeout_s=draw(st.sampled_from([5.0, 100.0]), label="flush_timeout_s"),
                every_steps=draw(st.integers(1, 2), label="checkpoint every_steps"),
                write_in_thread=False,
            ),
        )
    except ConfigError:
        assume(False)
        raise  # unreachable: assume(False) raises
    if unsafe:
        config = without_safety(config)
    verifier = draw(st.booleans(), label="verifier stage")
    return Setup(config, steps, teachers, agents, dp_sizes[: len(teachers)], verifier)


# -- one run of the pipeline ---------------------------------------------------------------


@attrs.define(eq=False)
class Incarnation:
    """One process's pipeline: the first, or one resumed after a crash."""

    pipeline: Pipeline
    generator: HeldGenerator
    scorer: HeldScorer
    learner: CheckingLearner
    directory: Path
    resumed_step: int | None = None
    """The step of the checkpoint it resumed from (None: it started from scratch)."""
    resumed_writer: Incarnation | None = None
    """The incarnation that wrote that checkpoint."""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: bool = False
    crashed: bool = False
    stop_requested: bool = False
    """An interrupt rule asked it to stop (`Pipeline.request_stop`)."""
    error: BaseException | None = None
    checked: bool = False


def interrupted(inc: Incarnation) -> bool:
    """It stopped early, cleanly, on request (not after its last step, not failed)."""
    return (
        inc.ended
        and inc.stop_requested
        and inc.error is None
        and not inc.crashed
        and not inc.pipeline.status.stopped
    )


class _Batches(Protocol):
    @property
    def batches(self) -> Sequence[TrainBatch]: ...


class Lineage(Protocol):
    """One process's run and the one whose checkpoint it resumed from, if any: what
    `trained_exactly_once` follows (an `Incarnation` of this machine or of another)."""

    @property
    def pipeline(self) -> Pipeline: ...

    @property
    def learner(self) -> _Batches: ...

    @property
    def resumed_step(self) -> int | None: ...

    @property
    def resumed_writer(self) -> Lineage | None: ...


def trained_exactly_once(last: Lineage, *, prompts: int, per_step: int) -> None:
    """Across `last` and the incarnations it resumed from (the checkpoints' lineage), each of
    the `prompts` was trained exactly once, in its own step, or given up."""
    trained: list[int] = []
    chain: list[tuple[Lineage, float]] = [(last, math.inf)]
    inc: Lineage | None = last
    while inc is not None and inc.resumed_step is not None:
        writer = inc.resumed_writer
        assert writer is not None
        chain.append((writer, inc.resumed_step))
        inc = writer
    for member, before in chain:
        for batch in member.learner.batches:
            if batch.step < before:
                ordinals = [g.ordinal for g in batch.groups]
                assert all(o is not None and o // per_step == batch.step for o in ordinals)
                trained.extend(o for o in ordinals if o is not None)
    twice = sorted(o for o, n in collections.Counter(trained).items() if n > 1)
    assert not twice, f"prompts {twice} trained twice"
    ledger = last.pipeline.ledger
    shortfall = set(ledger.shortfall)
    assert set(trained) == set(ledger.trained), (sorted(trained), sorted(ledger.trained))
    assert not set(trained) & shortfall
    missing = set(range(prompts)) - set(trained) - shortfall
    assert not missing, f"prompts {sorted(missing)} neither trained nor given up"
