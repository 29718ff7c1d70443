"""What every machine in this package shares: Hypothesis settings from a budget, and quiet
logs while a machine runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TypeVar, cast

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed

_M = TypeVar("_M", bound=type)


def budget(
    *,
    max_examples: int,
    steps: int,
    derandomize: bool = False,
    shrink: bool = True,
    seed: int | None = None,
) -> settings:
    """Settings for a state machine run of `max_examples` examples of up to `steps` steps.

    `derandomize` replays the same examples every time (for checks that must be repeatable, and
    then nothing is saved to the example database); `shrink=False` reports the first failure
    unshrunk, for when only "does it fail" matters. A run given a `seed` (see `seeded`) does
    not use the example database either: examples saved by other runs would come first, and
    the seed would no longer say which examples run.
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
    return settings(config, database=None) if derandomize or seed is not None else config


def seeded(machine: _M, seed: int | None) -> _M:
    """`machine` with Hypothesis's random seed fixed (`seed` None: as it is), on a subclass so
    the class itself is left alone. The same seed and budget generate the same examples."""
    if seed is None:
        return machine
    return cast(_M, hypothesis_seed(seed)(type(machine.__name__, (machine,), {})))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """groupflow's warnings silenced for the block: the faults a machine injects are its own
    doing, not news (and Python's last-resort handler would print each one)."""
    handler = logging.NullHandler()
    log = logging.getLogger("groupflow")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
