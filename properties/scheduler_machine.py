"""Random walks through the abstract scheduler model, checking every state on the way.

The exhaustive explorer is complete but only for tiny bounds; these walks reach larger bounds
(more prompts, teachers, faults) quickly and check the same invariants, so the two complement
each other. Bounds are drawn from the settings the real config accepts (the config's own
`problems()` are empty: flush timer on, capacity holding a whole step), where the explorer
finds no violation, across the modelled behaviours: no stage, one or two stages, in-order or
windowed sampling, failed train steps and aborts.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from groupflow.model.scheduler import (
    Bounds,
    CheckpointPolicy,
    Design,
    FailurePolicy,
    Phase,
    Sampler,
    apply,
    enabled,
    initial_state,
)
from groupflow.model.scheduler.checks import check_state
from groupflow.model.scheduler.explorer import is_deadlocked
from groupflow.model.shape import Shape
from groupflow.properties.budget import budget, seeded


@st.composite
def safe_bounds(draw: st.DrawFn) -> Bounds:
    """Bounds the real config would accept."""
    per_step = draw(st.integers(1, 4))
    max_batch = draw(st.integers(1, 4))
    bounds = Bounds(
        prompts=draw(st.integers(1, 12)),
        shape=Shape(
            prompts_per_step=per_step,
            max_inflight_prompts=draw(st.integers(1, 6)),
            max_batch_groups=max_batch,
            num_generations_per_prompt=draw(st.integers(1, 3)),
            max_buffered_groups=per_step + draw(st.integers(0, 4)),
            gate_window=draw(st.integers(0, 2)),
        ),
        teachers=draw(st.integers(1, 3)),
        crashes=draw(st.integers(0, 2)),
        checkpoints=draw(st.integers(0, 3)),
        rollout_failures=draw(st.integers(0, 2)),
        batch_failures=draw(st.integers(0, 2)),
        design=draw(st.sampled_from(Design)),
        demand=draw(st.booleans()),
        failure_policy=draw(st.sampled_from(FailurePolicy)),
        permanent_failures=draw(st.booleans()),
        checkpoint_policies=draw(
            st.sets(
                st.sampled_from([CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED]), min_size=1
            )
        ),
        drain_on_shutdown=draw(st.booleans()),
        interrupts=draw(st.booleans()),
        stages=draw(st.integers(0, 2)),
        sampler=draw(st.sampled_from(Sampler)),
        max_staleness=draw(st.integers(0, 2)),
        train_failures=draw(st.integers(0, 1)),
        aborts=draw(st.integers(0, 1)),
    )
    assume(not bounds.problems())
    return bounds


class SchedulerWalk(RuleBasedStateMachine):
    """One random run of the abstract scheduler per example."""

    @initialize(bounds=safe_bounds())
    def start(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.state = initial_state(bounds)

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        actions = enabled(self.state, self.bounds)
        if not actions:
            return
        action = data.draw(st.sampled_from(actions), label="action")
        self.state = apply(self.state, self.bounds, action)

    @invariant()
    def state_is_sound(self) -> None:
        if not hasattr(self, "state"):
            return
        violations = check_state(self.state, self.bounds)
        assert not violations, "\n".join(map(str, violations))
        assert not is_deadlocked(self.state, self.bounds), "deadlock"
        if self.state.phase is not Phase.DONE:
            assert enabled(self.state, self.bounds)


def run_scheduler_walks(
    *,
    max_examples: int = 200,
    steps: int = 100,
    derandomize: bool = False,
    seed: int | None = None,
) -> None:
    """Run `SchedulerWalk` with a budget (CI small, `groupflow fuzz` large; `seed` fixes the
    examples)."""
    run_state_machine_as_test(
        seeded(SchedulerWalk, seed),
        settings=budget(max_examples=max_examples, steps=steps, derandomize=derandomize, seed=seed),
    )
