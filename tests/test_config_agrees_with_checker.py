"""`PipelineConfig` accepts a configuration exactly when `groupflow check` finds no violation
for the matching bounds: the config's safety conditions and the checker's verdicts are tied
over a sweep of small bounds, for every design and dispatch setting the config allows."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from groupflow.impl.pipeline import PipelineConfig, ScoringConfig
from groupflow.impl.pipeline import _config as pipeline_config
from groupflow.model.policy import Design, Dispatch
from groupflow.model.scheduler import Bounds
from groupflow.model.scheduler.explorer import explore

GRID = [
    dict(
        prompts_per_step=p,
        max_buffered_groups=c,
        max_inflight_prompts=i,
        max_batch_groups=m,
        teachers=t,
        gate_window=g,
    )
    for p, c, i, m, t, g in itertools.product(
        [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2], [0, 1]
    )
]
SETTINGS = [
    (Design.PUMP, Dispatch.TIMER),
    (Design.PUMP, Dispatch.DEMAND),
    (Design.INLINE, Dispatch.TIMER),
]


def _config(cfg: dict[str, Any], design: Design, dispatch: Dispatch) -> PipelineConfig:
    return PipelineConfig(
        prompts_per_step=cfg["prompts_per_step"],
        num_generations_per_prompt=1,
        max_inflight_prompts=cfg["max_inflight_prompts"],
        max_buffered_groups=cfg["max_buffered_groups"],
        gate_window=cfg["gate_window"],
        scoring=ScoringConfig(
            max_batch_groups=cfg["max_batch_groups"],
            flush_after_s=1.0,
            design=design,
            dispatch=dispatch,
        ),
    )


def _accepted(cfg: dict[str, Any], design: Design, dispatch: Dispatch) -> bool:
    try:
        _config(cfg, design, dispatch)
    except ValueError:
        return False
    return True


def _disagreements(
    design: Design, dispatch: Dispatch, grid: list[dict[str, Any]]
) -> tuple[list[tuple[dict[str, Any], bool, bool]], int]:
    """(config, accepted, safe) where the config and the checker disagree; bounds refused."""
    disagree: list[tuple[dict[str, Any], bool, bool]] = []
    refused = 0
    for cfg in grid:
        bounds = Bounds(
            **cfg,
            prompts=min(cfg["prompts_per_step"] * 2 + 1, 5),
            num_generations_per_prompt=1,
            design=design,
            flush_timer=True,
            demand=dispatch is Dispatch.DEMAND,
            checkpoints=1,
            interrupts=False,
        )
        safe = explore(bounds).ok
        accepted = _accepted(cfg, design, dispatch)
        refused += not accepted
        if safe != accepted:
            disagree.append((cfg, accepted, safe))
    return disagree, refused


@pytest.mark.parametrize(("design", "dispatch"), SETTINGS, ids=lambda v: str(v))
def test_config_agrees_with_checker(design: Design, dispatch: Dispatch) -> None:
    disagree, refused = _disagreements(design, dispatch, GRID)
    assert not disagree, f"config (accepted) and checker (safe) disagree on {disagree}"
    assert 0 < refused < len(GRID)  # the sweep holds both verdicts


def test_sweep_catches_a_config_that_forgets_a_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the config's copy of the conditions forgets the buffer-smaller-than-a-step
    one (the config accepts what deadlocks)."""
    monkeypatch.setattr(pipeline_config, "config_problems", lambda **facts: [])
    small = [cfg for cfg in GRID if cfg["teachers"] == 1 and cfg["max_batch_groups"] == 2]
    disagree, _ = _disagreements(Design.PUMP, Dispatch.DEMAND, small)
    assert disagree and all(accepted and not safe for _, accepted, safe in disagree)
