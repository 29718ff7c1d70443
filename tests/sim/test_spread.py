"""Measured spreads (`groupflow.sim.spread`): the quantiles a fit keeps, the draws the
simulator makes from them, and a round trip through a simulated run whose syncs and teacher
calls are bimodal, as a served engine's are.

Seeded bug, caught by the test named after it: a fit that keeps no spread (each time at its
mean), whose simulation then never waits after a short sync."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from groupflow.sim import calibrate as calibrate_module
from groupflow.sim.calibrate import calibrate, simulated_terms, variant_of
from groupflow.sim.scenario import parse_scenario, scenario_toml
from groupflow.sim.spread import SHARES, as_spread, draw, measured, rng


def test_measured_keeps_the_mean_and_the_shape() -> None:
    ratios = [0.1] * 50 + [1.9] * 50
    kept = measured(ratios)
    assert len(kept) == SHARES and list(kept) == sorted(kept)
    assert statistics.fmean(kept) == pytest.approx(1.0, abs=1e-5)
    assert kept[0] == pytest.approx(0.1) and kept[-1] == pytest.approx(1.9)
    assert measured([1.0]) == () and measured([]) == ()


def test_draws_take_each_multiplier_an_equal_share_and_repeat() -> None:
    multipliers = (0.5, 1.0, 1.5, 2.0)
    draws = [draw(multipliers, rng(0, "test", i)) for i in range(4000)]
    for m in multipliers:
        assert draws.count(m) == pytest.approx(1000, rel=0.1)
    assert draws == [draw(multipliers, rng(0, "test", i)) for i in range(4000)]
    assert draw((), random.Random(0)) == 1.0


@pytest.mark.parametrize("value", ["0.5", [0.5, 0], [1.0, -1.0], [float("nan")], [[1.0]]])
def test_a_spread_that_is_not_positive_numbers_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match="spread must be a list of") as info:
        as_spread(value)
    assert repr(value) in str(info.value)


def _fitted_error(served_run: tuple[Path, Any]) -> tuple[Any, float]:
    trace, truth = served_run
    fit = calibrate(trace)
    result, _ = simulated_terms(fit.scenario, variant_of(fit.scenario.pipeline))
    return fit, result.s_per_step / truth.s_per_step - 1


def test_a_bimodal_run_is_fitted_back_with_its_spread(served_run: tuple[Path, Any]) -> None:
    fit, error = _fitted_error(served_run)
    teacher = fit.scenario.teachers["teacher"]
    sync = fit.scenario.weight_sync
    assert sync is not None
    for kept in (teacher.spread, sync.spread):
        assert len(kept) == SHARES
        assert max(kept[: SHARES // 2 - 1]) < 0.5 < 1.5 < min(kept[SHARES // 2 + 1 :]), kept
    assert abs(error) < 0.05, error
    assert parse_scenario(scenario_toml(fit.scenario)) == fit.scenario


def test_seeded_bug_a_fit_without_spread_is_caught(
    served_run: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate_module, "measured", lambda ratios: ())
    _, error = _fitted_error(served_run)
    with pytest.raises(AssertionError):
        assert abs(error) < 0.05, error
