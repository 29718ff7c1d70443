"""Pipeline configs refuse, when built, what the checker shows would hang."""

from __future__ import annotations

from typing import Any

import pytest

from groupflow.impl._pipeline import CheckpointConfig, Dispatch, PipelineConfig, ScoringConfig
from groupflow.impl.errors import ConfigError
from groupflow.model.policy import Design, FailurePolicy
from groupflow.model.shape import Shape

RECIPE = Shape(
    prompts_per_step=8, num_generations_per_prompt=4, max_inflight_prompts=8, max_buffered_groups=16
)


def test_shipped_recipe_shape_is_accepted_with_defaults() -> None:
    config = PipelineConfig(
        shape=RECIPE.evolve(max_batch_groups=7), scoring=ScoringConfig(flush_after_s=2.0)
    )
    assert config.scoring is not None
    assert config.scoring.dispatch is Dispatch.DEMAND
    assert config.scoring.design is Design.PUMP
    assert config.scoring.failure_policy is FailurePolicy.RETRY
    assert config.checkpoints is None


def test_batch_as_large_as_the_permits_is_accepted() -> None:
    """With the flush timer always on, the checker finds no deadlock for any batch size: the
    permit is free while a batch waits (see the sweep in `test_config_agrees_with_checker.py`)."""
    PipelineConfig(
        shape=RECIPE.evolve(max_batch_groups=9), scoring=ScoringConfig(flush_after_s=1.0)
    )


def test_buffer_smaller_than_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_buffered_groups=7 .* prompts_per_step=8"):
        PipelineConfig(shape=RECIPE.evolve(max_buffered_groups=7))


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_flush_timer_must_be_positive_seconds(seconds: Any) -> None:
    with pytest.raises(ValueError, match=r"flush_after_s must be a finite number of seconds > 0"):
        ScoringConfig(flush_after_s=seconds)


@pytest.mark.parametrize(
    "field",
    [
        "prompts_per_step",
        "num_generations_per_prompt",
        "max_inflight_prompts",
        "max_buffered_groups",
    ],
)
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_sizes_must_be_positive_ints(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"Shape.{field} must be a positive int, got {value!r}"):
        RECIPE.evolve(**{field: value})


def test_the_shape_must_be_a_shape() -> None:
    with pytest.raises(ConfigError, match="PipelineConfig.shape must be a Shape, got {'prompts"):
        PipelineConfig(shape={"prompts_per_step": 8})  # type: ignore[arg-type]


def test_gate_window_may_be_zero_but_not_negative() -> None:
    PipelineConfig(shape=RECIPE.evolve(gate_window=0))
    with pytest.raises(ValueError, match="gate_window must be an int >= 0, got -1"):
        PipelineConfig(shape=RECIPE.evolve(gate_window=-1))


@pytest.mark.parametrize("field", ["stall_timeout_s", "shutdown_timeout_s"])
def test_timeouts_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        overrides: dict[str, Any] = {field: 0}
        PipelineConfig(shape=RECIPE, **overrides)
    with pytest.raises(ValueError, match="flush_timeout_s"):
        CheckpointConfig("ckpt", every_steps=1, flush_timeout_s=0)


def test_checker_only_designs_and_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="coalesce.*groupflow check"):
        ScoringConfig(flush_after_s=1.0, design="coalesce")
    with pytest.raises(ValueError, match="naive.*loses prompts"):
        CheckpointConfig("ckpt", every_steps=1, policy="naive")


def test_checkpoints_must_be_a_checkpoint_config() -> None:
    with pytest.raises(ConfigError, match="must be a CheckpointConfig or None"):
        PipelineConfig(shape=RECIPE, checkpoints={"every_steps": 2})  # type: ignore[arg-type]


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="'sometimes'"):
        ScoringConfig(flush_after_s=1.0, dispatch="sometimes")
    with pytest.raises(ValueError, match="'explode'"):
        ScoringConfig(flush_after_s=1.0, failure_policy="explode")
    with pytest.raises(ValueError, match="'sometimes'"):
        PipelineConfig(shape=RECIPE, stall_action="sometimes")
