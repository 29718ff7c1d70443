"""Hypothesis settings from a budget, shared by every machine in this package."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings


def budget(
    *, max_examples: int, steps: int, derandomize: bool = False, shrink: bool = True
) -> settings:
    """Settings for a state machine run of `max_examples` examples of up to `steps` steps.

    `derandomize` replays the same examples every time (for checks that must be repeatable, and
    then nothing is saved to the example database); `shrink=False` reports the first failure
    unshrunk, for when only "does it fail" matters.
    """
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if shrink:
        phases.append(Phase.shrink)
    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return settings(config, database=None) if derandomize else config
