"""A measured spread: the multipliers of a time around its mean, one drawn per event.

A served engine's times are rarely one bell: a weight sync or a teacher call either slips
between the other work on the machine or queues behind it, and what a step waits for is
decided by which. A fit keeps the times it saw as equal-share quantiles of their ratio to the
model's prediction (mean 1), and the simulator draws one per event from a keyed generator, so
the same scenario and seed draw the same times."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

SHARES = 20
"""How many quantiles a fit keeps: enough for a tail one event in ten takes."""


def rng(seed: int, *key: object) -> random.Random:
    """A generator for one draw, fixed by the seed and the key (stable across processes)."""
    return random.Random("/".join(map(str, (seed, *key))))


def as_spread(value: Any, name: str = "spread") -> tuple[float, ...]:
    """The converter of a model's `spread` field (`name`): a list of multipliers > 0 (empty:
    none)."""
    try:
        multipliers = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers > 0, got {value!r}") from None
    if isinstance(value, str) or not all(math.isfinite(m) and m > 0 for m in multipliers):
        raise ValueError(f"{name} must be a list of finite numbers > 0, got {value!r}")
    return multipliers


def draw(multipliers: Sequence[float], generator: random.Random) -> float:
    """One multiplier, each with an equal share (1 without a spread)."""
    if not multipliers:
        return 1.0
    return multipliers[int(generator.random() * len(multipliers))]


def measured(ratios: Sequence[float], shares: int = SHARES) -> tuple[float, ...]:
    """`shares` equal-share quantiles of `ratios` (each a time over its prediction), scaled to
    mean 1 so that the spread keeps the model's mean; empty for fewer than two ratios."""
    positive = sorted(r for r in ratios if r > 0 and math.isfinite(r))
    if len(positive) < 2:
        return ()
    n = len(positive)
    picks = [positive[min(n - 1, int((i + 0.5) * n / shares))] for i in range(shares)]
    mean = statistics.fmean(picks)
    return tuple(round(p / mean, 6) for p in picks)
