"""The explorer's reductions (canonical states, persistent sets) agree with the full search,
and a reduction that is wrong in a plausible way is caught by the same checks."""

from __future__ import annotations

import pytest

from groupflow.model.policy import CheckpointPolicy, Sampler
from groupflow.model.scheduler import Phase, initial_state, reduction
from groupflow.model.scheduler import canonical as canonical_module
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.explorer import compare_reduction, explore
from groupflow.model.shape import Shape
from groupflow.properties.reduction_sweep import run_sweep, sweep_bounds


def test_quick_sweep_agrees_with_the_full_search() -> None:
    results = run_sweep(sweep_bounds(quick=True))
    assert len(results) >= 15
    bad = [(r.full.bounds, r.problems) for r in results if r.problems]
    assert not bad, bad
    # Not vacuous: some bounds have violations (their traces were confirmed), and most are
    # reduced.
    assert sum(bool(r.full.findings) for r in results) >= 3
    assert sum(r.reduced.reduced > 0 for r in results) >= len(results) // 2


def test_the_reductions_shrink_the_defaults() -> None:
    full = explore(Bounds(), reduce=False)
    reduced = explore(Bounds())
    assert full.ok and reduced.ok
    assert reduced.states * 3 < full.states
    assert reduced.reduced > 0


def test_canonical_states_keep_what_a_crash_reads() -> None:
    b = Bounds(crashes=1)
    s = initial_state(b)._replace(phase=Phase.SHUTDOWN, reissue=(3, 1))
    kept = canonical_module.canonical(s, b)
    assert kept.crashes_left == 1 and kept.checkpoints_left == 1
    assert kept.reissue == (1, 3)  # shutting down: only the set is read
    running = canonical_module.canonical(s._replace(phase=Phase.RUNNING), b)
    assert running.reissue == (3, 1)  # running: admission reads the order


def test_seeded_bug_canonical_form_that_forgets_the_checkpoint_a_crash_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: `saved` erased although a crash is still possible. The naive checkpoint's
    lost prompts (found by the full search) are no longer found."""
    original = canonical_module.canonical_without_groups

    def forgetful(s):  # type: ignore[no-untyped-def]
        return original(s)._replace(saved=None)

    monkeypatch.setattr("groupflow.model.scheduler.explorer.canonical_without_groups", forgetful)
    b = Bounds(crashes=1, checkpoint_policies={CheckpointPolicy.NAIVE})
    problems = compare_reduction(b).problems
    assert any("full search finds" in p for p in problems), problems


def test_seeded_bug_reduction_that_ignores_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a call's return chosen alone while a checkpoint may still start (the
    checkpoint reads which groups are pending, so the two do not commute)."""

    def careless(s, b):  # type: ignore[no-untyped-def]
        return not s.failed and s.crashes_left == 0 and s.aborts_left == 0

    monkeypatch.setattr(reduction, "_state_allows", careless)
    problems = compare_reduction(Bounds()).problems
    assert any("do not commute" in p or "disables" in p for p in problems), problems


def test_seeded_bug_reduction_of_a_first_stage_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: with two stages, a first-stage call returning feeds the verifier's queue,
    so its order against another teacher's return matters; choosing it alone is wrong."""

    def first_stage_too(s, b, actions):  # type: ignore[no-untyped-def]
        for lane, batches in enumerate(s.inflight):
            if batches:
                chosen = [a for a in actions if a.lane == lane and a.kind in reduction._CALL_ENDS]
                if chosen and len(chosen) < len(actions):
                    return chosen
        return None

    monkeypatch.setattr("groupflow.model.scheduler.explorer.ample", first_stage_too)
    b = Bounds(stages=2, teachers=2, checkpoints=0, interrupts=False)
    problems = compare_reduction(b).problems
    assert any("do not commute" in p for p in problems), problems


def test_windowed_sampler_is_not_reduced() -> None:
    """A step of the windowed sampler trains whichever groups are READY, so a call's return
    commutes with nothing that trains: the persistent sets stay off."""
    report = explore(Bounds(sampler=Sampler.WINDOWED, max_staleness=0, checkpoints=0))
    assert report.ok and report.reduced == 0


def test_the_checker_finds_the_same_first_traces_reduced_or_not() -> None:
    """The README's deadlock: both searches report one, of the same (shortest) length."""
    b = Bounds(teachers=2, shape=Shape(gate_window=0), flush_timer=False)
    full = explore(b, reduce=False)
    reduced = explore(b)
    assert [f.kind for f in full.findings] == [f.kind for f in reduced.findings] == ["deadlock"]
    assert len(reduced.findings[0].trace) == len(full.findings[0].trace)
    assert reduced.findings[0].confirm(b) is None
