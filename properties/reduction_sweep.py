"""The explorer's reductions, checked against the full search over a sweep of bounds.

`groupflow check` stores one state per class of states with the same future and expands a
persistent subset of actions where one exists (`groupflow.model.scheduler.canonical`,
`groupflow.model.scheduler.reduction`). Both rest on arguments about which actions commute and which
fields are dead; this sweep is the evidence that the arguments hold for the model as it is
now: over every setting the checker knows (designs, dispatch, failure and checkpoint
policies, faults, stages, samplers, shutdown), the reduced search finds exactly the
violations the full one finds, each of its traces is a real run ending in its violation, and
in every reduced state the chosen actions commute with the others. CI runs the quick sweep
(`tests/model/test_reduction.py`); `python bench/checker_rate.py --sweep` runs the whole one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from groupflow.model.policy import CheckpointPolicy, Design, FailurePolicy, Sampler
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.explorer import Comparison, compare_reduction
from groupflow.model.shape import Shape, split_shape

_SMALL: dict[str, object] = dict(  # the sizes by their flat names, as `groupflow check` takes them
    prompts=4,
    prompts_per_step=2,
    max_inflight_prompts=3,
    max_batch_groups=2,
    max_buffered_groups=4,
    gate_window=1,
)

_VARIANTS: tuple[tuple[dict[str, object], bool], ...] = (
    # (settings, in the quick sweep)
    ({}, True),
    (dict(demand=True), True),
    (dict(flush_timer=False), True),
    (dict(flush_timer=False, demand=True), True),
    (dict(flush_timer=False, gate_window=0, teachers=2), True),  # the README's deadlock
    (dict(max_buffered_groups=1), True),  # smaller than a step: deadlock
    (dict(crashes=1), True),
    (dict(crashes=1, checkpoint_policies={CheckpointPolicy.NAIVE}), True),  # prompts lost
    (dict(crashes=1, checkpoints=2, teachers=2), False),
    (dict(checkpoints=0, batch_failures=2), True),
    (dict(checkpoints=0, batch_failures=2, permanent_failures=True), True),
    (dict(crashes=1, batch_failures=1, permanent_failures=True), False),
    (dict(checkpoints=0, batch_failures=1, failure_policy=FailurePolicy.DISCARD), True),
    (dict(batch_failures=1, failure_policy=FailurePolicy.FAIL), True),
    (dict(rollout_failures=1, crashes=1), False),
    (dict(train_failures=1), True),
    (dict(aborts=1), True),
    (dict(drain_on_shutdown=False, crashes=1), True),
    (dict(interrupts=False), True),
    (dict(stages=0), True),
    (dict(stages=2, teachers=2), False),
    (dict(stages=2, checkpoints=0), True),
    (dict(sampler=Sampler.WINDOWED, max_staleness=0, rollout_failures=1), False),
    (dict(sampler=Sampler.WINDOWED, max_staleness=0, checkpoints=0), True),
    (dict(teachers=2, routing=(0, 0, 1, 0)), True),
    (dict(teachers=2, demand=True, flush_timer=False, batch_failures=1), False),
)


def sweep_bounds(*, quick: bool) -> Iterator[Bounds]:
    """The whole sweep: each variant under every design, at four prompts, and also at three
    prompts, with more permits, and at six prompts in steps of three. The quick one (CI):
    the pump design at four prompts, the variants whose full search stays small."""
    sizes: list[dict[str, object]] = [_SMALL]
    designs = [Design.PUMP] if quick else list(Design)
    if not quick:
        sizes += [
            dict(_SMALL, prompts=3, max_inflight_prompts=2),
            dict(_SMALL, max_inflight_prompts=4, gate_window=2),
            dict(_SMALL, prompts=6, prompts_per_step=3, max_buffered_groups=6, max_batch_groups=3),
        ]
    for size, (variant, in_quick), design in itertools.product(sizes, _VARIANTS, designs):
        if quick and not in_quick:
            continue
        settings = {**size, **variant, "design": design}
        if len(settings.get("routing", ())) not in (0, settings["prompts"]):  # type: ignore[arg-type]
            continue
        shape, rest = split_shape(settings, Shape())
        yield Bounds(shape=shape, **rest)


def run_sweep(
    bounds: Iterable[Bounds],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[Comparison]:
    """`compare_reduction` for each bounds; an empty `problems` is agreement."""
    out = []
    for i, b in enumerate(bounds):
        out.append(compare_reduction(b))
        if progress is not None:
            progress(i + 1)
    return out
