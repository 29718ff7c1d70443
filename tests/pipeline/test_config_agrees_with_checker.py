"""`PipelineConfig` accepts a configuration exactly when `groupflow check` finds no violation
for the matching bounds: the config's safety conditions and the checker's verdicts are tied
over a sweep of small bounds, for every design and dispatch setting the config allows."""

from __future__ import annotations

import itertools

import pytest

from groupflow.impl._pipeline import PipelineConfig, ScoringConfig
from groupflow.impl._pipeline import _config as pipeline_config
from groupflow.model.policy import Design, Dispatch
from groupflow.model.scheduler import Bounds
from groupflow.model.scheduler.explorer import explore
from groupflow.model.shape import Shape

GRID = [
    (
        Shape(
            prompts_per_step=p,
            num_generations_per_prompt=1,
            max_buffered_groups=c,
            max_inflight_prompts=i,
            max_batch_groups=m,
            gate_window=g,
        ),
        t,
    )
    for p, c, i, m, t, g in itertools.product(
        [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2], [0, 1]
    )
]
"""Each shape with a count of teachers: the config holds the shape, and so do the bounds."""
SETTINGS = [
    (Design.PUMP, Dispatch.TIMER),
    (Design.PUMP, Dispatch.DEMAND),
    (Design.INLINE, Dispatch.TIMER),
]


def _accepted(shape: Shape, design: Design, dispatch: Dispatch) -> bool:
    try:
        PipelineConfig(
            shape=shape, scoring=ScoringConfig(flush_after_s=1.0, design=design, dispatch=dispatch)
        )
    except ValueError:
        return False
    return True


def _disagreements(
    design: Design, dispatch: Dispatch, grid: list[tuple[Shape, int]]
) -> tuple[list[tuple[Shape, int, bool, bool]], int]:
    """(shape, teachers, accepted, safe) where the config and the checker disagree; and how
    many configs were refused."""
    disagree: list[tuple[Shape, int, bool, bool]] = []
    refused = 0
    for shape, teachers in grid:
        bounds = Bounds(
            prompts=min(shape.prompts_per_step * 2 + 1, 5),
            shape=shape,
            teachers=teachers,
            design=design,
            flush_timer=True,
            demand=dispatch is Dispatch.DEMAND,
            checkpoints=1,
            interrupts=False,
        )
        safe = explore(bounds).ok
        accepted = _accepted(shape, design, dispatch)
        refused += not accepted
        if safe != accepted:
            disagree.append((shape, teachers, accepted, safe))
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
    small = [(s, t) for s, t in GRID if t == 1 and s.max_batch_groups == 2]
    disagree, _ = _disagreements(Design.PUMP, Dispatch.DEMAND, small)
    assert disagree and all(accepted and not safe for _, _, accepted, safe in disagree)
