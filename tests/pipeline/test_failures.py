"""Only what can go away is retried: the classifier (`is_transient`), the config that lists
what counts, the stage and the inline baseline applying the rule, the warning they log, and a
live run with permanent failures checked against the model. Seeded bugs on both sides show
the checks can fail."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import PipelineConfig, ScoringConfig
from groupflow.impl._pipeline import (
    DEFAULT_TRANSIENT_ERRORS,
    ScoringStage,
    build_pipeline,
    is_transient,
)
from groupflow.impl._pipeline import _inline_baseline as inline_module
from groupflow.impl._pipeline import _scoring_stage as stage_module
from groupflow.impl.contract import ScoreRequest
from groupflow.impl.errors import (
    ConfigError,
    MissingDataError,
    ScoringCallFailed,
    TeacherOutputError,
    TransientError,
)
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState, assert_invariants, decisions, scheduler
from groupflow.model.policy import FailurePolicy
from groupflow.model.scheduler import transitions
from groupflow.model.scheduler.actions import PERMANENT_FAILURE, Action, ActionKind
from groupflow.sim.verify.conformance import Conformance, ConformanceError, bounds_for
from tests.helpers import STEP_OF_FOUR, scoring_buffer, written

GROUP_SIZE = 2
ErrorFactory = Callable[[int, ScoreRequest], Exception]


def _raising(make: Callable[[], Exception]) -> ErrorFactory:
    return lambda index, request: make()


def scoring(**overrides: Any) -> ScoringConfig:
    settings: dict[str, Any] = {"flush_after_s": 5.0}
    settings.update(overrides)
    return ScoringConfig(**settings)


async def _run_stage(
    scorer: FakeScorer, config: ScoringConfig, groups: int, *, max_batch_groups: int = 2
) -> tuple[ScoringStage, list[str], list[tuple[str, str]]]:
    """Score `groups` WRITTEN groups through a stage until it drains (bounded in virtual
    time); returns the stage, the group ids and what `on_discard` heard."""
    buffer = scoring_buffer(group_size=GROUP_SIZE, capacity=16)
    discarded: list[tuple[str, str]] = []
    stage = ScoringStage(
        buffer,
        scorer,
        config,
        max_batch_groups=max_batch_groups,
        on_discard=lambda view, why: discarded.append((view.group_id, why)),
    )
    ids = await written(buffer, groups)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(1_000):
        await stage.run()
    assert_invariants(buffer.snapshot())
    return stage, ids, discarded


# -- the classifier ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        OSError("disk"),
        ConnectionResetError("reset by peer"),
        TimeoutError("read timed out"),
        trio.TooSlowError(),
        TransientError("server busy"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_can_go_away_is_transient_by_default(error: Exception) -> None:
    assert is_transient(error, DEFAULT_TRANSIENT_ERRORS)


@pytest.mark.parametrize(
    "error",
    [
        IndexError("index 50257 is out of bounds for dimension 0 with size 32000"),
        TypeError("score() takes 1 positional argument but 2 were given"),
        ConfigError("vocab_size must be positive", field="vocab_size"),
        TeacherOutputError("teacher returned non-finite log-probs for rows 'g/0'"),
        MissingDataError("rows lack teacher_reference_logprobs", rows=["g/0"]),
        ScoringCallFailed("policy says fail"),
        ValueError("bad"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_stays_is_permanent_by_default(error: Exception) -> None:
    assert not is_transient(error, DEFAULT_TRANSIENT_ERRORS)


def _fake_class(name: str, module: str, base: type[Exception] = RuntimeError) -> type[Exception]:
    return type(name, (base,), {"__module__": module})


@pytest.mark.parametrize("module", ["torch", "torch.cuda", "torch.cuda.memory"])
def test_torch_out_of_memory_is_transient_by_name(module: str) -> None:
    """The pipeline does not import torch: the class is told by its name and module, also in
    a subclass, whatever `transient_errors` lists."""
    oom = _fake_class("OutOfMemoryError", module)
    assert is_transient(oom("CUDA out of memory. Tried to allocate 2.00 GiB"), ())
    assert is_transient(_fake_class("MyOOM", "mine", oom)("again"), ())


@pytest.mark.parametrize("module", ["mylib", "torchvision", "nottorch.cuda"])
def test_an_out_of_memory_error_elsewhere_is_not_torchs(module: str) -> None:
    assert not is_transient(_fake_class("OutOfMemoryError", module)("no"), DEFAULT_TRANSIENT_ERRORS)


def test_the_real_torch_out_of_memory_error_is_transient() -> None:
    torch = pytest.importorskip("torch", reason="torch not installed")
    assert is_transient(torch.cuda.OutOfMemoryError("CUDA out of memory"), ())


def test_an_exception_group_is_transient_only_if_all_of_it_is() -> None:
    """Scoring failed and clearing the pad rows failed too: one error that stays makes the
    retry fail as well."""
    both = ExceptionGroup("scoring and cleanup", [ConnectionError("a"), TimeoutError("b")])
    mixed = ExceptionGroup("scoring and cleanup", [ConnectionError("a"), IndexError("b")])
    assert is_transient(both, DEFAULT_TRANSIENT_ERRORS)
    assert not is_transient(mixed, DEFAULT_TRANSIENT_ERRORS)


def test_the_decision_never_retries_a_permanent_failure() -> None:
    retry = FailurePolicy.RETRY
    assert decisions.retry_after_failure(retry, 0, transient=True)
    assert not decisions.retry_after_failure(retry, 1, transient=True)
    assert not decisions.retry_after_failure(retry, 0, transient=False)
    for policy in (FailurePolicy.DISCARD, FailurePolicy.FAIL):
        assert not decisions.retry_after_failure(policy, 0, transient=True)
        assert not decisions.permanence_matters(policy)
    assert decisions.permanence_matters(retry)


# -- the config ----------------------------------------------------------------------------


def test_the_config_lists_the_defaults_and_takes_any_iterable() -> None:
    assert scoring().transient_errors == DEFAULT_TRANSIENT_ERRORS
    assert scoring(transient_errors=[KeyError]).transient_errors == (KeyError,)
    assert scoring(transient_errors=()).transient_errors == ()


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("OSError", "'OSError'"),
        (KeyError, "write (KeyError,)"),
        ((KeyError, 3), "3"),
        ((ValueError("caught"),), "ValueError('caught')"),
        ((int,), "<class 'int'>"),
        (None, "None"),
    ],
    ids=["a-name", "a-bare-class", "a-number", "an-instance", "not-an-exception", "none"],
)
def test_the_config_refuses_what_is_not_exception_classes(value: object, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        scoring(transient_errors=value)
    assert info.value.field == "transient_errors"
    assert "ScoringConfig.transient_errors" in str(info.value) and shown in str(info.value)


# -- the stage -----------------------------------------------------------------------------


async def test_a_connection_error_is_retried_and_the_group_ends_ready(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    scorer = FakeScorer(
        fail=lambda i, r: i == 0, error=_raising(lambda: ConnectionError("connection reset"))
    )
    with caplog.at_level(logging.WARNING, logger="groupflow.teacher"):
        stage, ids, discarded = await _run_stage(scorer, scoring(), groups=1)
    assert [c.group_ids for c in scorer.calls] == [(ids[0],), (ids[0],)]
    assert stage.buffer.state_of(ids[0]) is GroupState.READY
    assert discarded == []
    metrics = stage.drain_metrics()
    assert (metrics.failures, metrics.retries, metrics.discards) == (1, 1, 0)
    (record,) = caplog.records
    assert "'teacher'" in record.getMessage() and ids[0] in record.getMessage()
    assert "ConnectionError('connection reset')" in record.getMessage()
    assert "retrying" in record.getMessage()


PERMANENT_ERRORS = [
    pytest.param(lambda: IndexError("token id 50257 out of range"), id="IndexError"),
    pytest.param(lambda: ConfigError("vocab_size too small", field="vocab_size"), id="ConfigError"),
    pytest.param(lambda: TypeError("unsupported operand"), id="TypeError"),
]


async def _check_permanent_error_is_not_retried(
    make: Callable[[], Exception], caplog: pytest.LogCaptureFixture
) -> None:
    """A batch of two fails with `make()`: one call, both groups given up as failed (the
    ledger's shortfall), a warning that says they are not retried."""
    scorer = FakeScorer(fail=lambda i, r: i == 0, error=_raising(make))
    with caplog.at_level(logging.WARNING, logger="groupflow.teacher"):
        stage, ids, discarded = await _run_stage(scorer, scoring(), groups=2)
    assert [c.group_ids for c in scorer.calls] == [tuple(ids)], "a permanent error is not retried"
    assert [stage.buffer.state_of(g) for g in ids] == [GroupState.DISCARDED] * 2
    assert discarded == [(g, "failed") for g in ids]
    metrics = stage.drain_metrics()
    assert (metrics.failures, metrics.retries, metrics.discards) == (1, 0, 2)
    (record,) = caplog.records
    message = record.getMessage()
    assert all(g in message for g in ids) and repr(make())[:20] in message
    assert "not retried" in message and "not a transient error" in message


@pytest.mark.parametrize("make", PERMANENT_ERRORS)
async def test_a_permanent_error_gives_its_groups_up_without_a_retry(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    make: Callable[[], Exception],
) -> None:
    await _check_permanent_error_is_not_retried(make, caplog)


async def test_seeded_bug_a_stage_that_calls_every_error_transient_is_caught(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the old behaviour, every failure retried. The IndexError check fails."""
    monkeypatch.setattr(stage_module, "is_transient", lambda error, transient_errors: True)
    with pytest.raises(AssertionError, match="a permanent error is not retried"):
        await _check_permanent_error_is_not_retried(lambda: IndexError("out of range"), caplog)


async def test_permanent_failures_in_a_row_still_fail_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing is retried, so each failed call is a new group; the fourth call is never made."""
    scorer = FakeScorer(fail=lambda i, r: True, error=_raising(lambda: IndexError("vocab")))
    config = scoring(max_consecutive_failed_batches=2)
    with pytest.raises(ScoringCallFailed, match=r"3 calls in a row failed.*IndexError"):
        await _run_stage(scorer, config, groups=5, max_batch_groups=1)
    assert len(scorer.calls) == 3
    assert len({c.group_ids for c in scorer.calls}) == 3, "no group was called twice"


async def test_a_users_transient_error_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scorer = FakeScorer(
        fail=lambda i, r: i == 0, error=_raising(lambda: TransientError("teacher restarting"))
    )
    stage, ids, discarded = await _run_stage(scorer, scoring(), groups=2)
    assert [len(c.group_ids) for c in scorer.calls] == [2, 1, 1]
    assert {stage.buffer.state_of(g) for g in ids} == {GroupState.READY}
    assert discarded == []


async def test_custom_transient_errors_replace_the_defaults(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`transient_errors=(KeyError,)`: a KeyError is retried, and an OSError no longer is."""
    config = scoring(transient_errors=(KeyError,))
    scorer = FakeScorer(fail=lambda i, r: i == 0, error=_raising(lambda: KeyError("shard 3")))
    stage, ids, discarded = await _run_stage(scorer, config, groups=1)
    assert len(scorer.calls) == 2 and stage.buffer.state_of(ids[0]) is GroupState.READY
    scorer = FakeScorer(fail=lambda i, r: i == 0, error=_raising(lambda: OSError("down")))
    stage, ids, discarded = await _run_stage(scorer, config, groups=1)
    assert len(scorer.calls) == 1 and discarded == [(ids[0], "failed")]


async def test_under_discard_a_permanent_failure_reads_as_any_other(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`discard` gives the groups up either way: the failure is reported without a detail."""
    actions: list[Action] = []
    buffer = scoring_buffer(group_size=GROUP_SIZE, capacity=16)
    scorer = FakeScorer(fail=lambda i, r: True, error=_raising(lambda: IndexError("vocab")))
    stage = ScoringStage(buffer, scorer, scoring(failure_policy="discard"), max_batch_groups=2)
    stage.status.observer = _Recorder(actions)
    for gid in await written(buffer, 2):
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(1_000):
        await stage.run()
    assert [a for a in actions if a.kind is ActionKind.SCORE_FAIL] == [
        Action(ActionKind.SCORE_FAIL, lane=0)
    ]


class _Recorder:
    def __init__(self, actions: list[Action]) -> None:
        self.actions = actions

    def on_action(self, action: Action) -> None:
        self.actions.append(action)


# -- whole runs, both designs, checked against the model --------------------------------------

RECIPE = STEP_OF_FOUR
PROMPTS = 8


async def _checked_run(
    design: str, error: Callable[[], Exception], *, failing: frozenset[int] = frozenset({0, 2})
) -> tuple[Conformance, FakeScorer, frozenset[int]]:
    """A whole run whose teacher calls numbered `failing` raise `error()`, every action
    checked against the model (`bounds_for`: permanent failures on). Returns the checker,
    the scorer and the run's shortfall."""
    config = PipelineConfig(
        shape=RECIPE,
        scoring=ScoringConfig(flush_after_s=2.0, design=design),
    )
    scorer = FakeScorer(fixed=2.0, fail=lambda i, r: i in failing, error=_raising(error))
    pipeline = build_pipeline(
        config,
        prompts=list(range(PROMPTS)),
        generator=FakeGenerator(latency=lambda o: 1.0 + (o % 3)),
        learner=FakeLearner(),
        scorer=scorer,
        train_fields=["input_ids", "generation_logprobs"],
        lanes={"teacher": 0},
    )
    checker = Conformance(bounds_for(config, prompts=PROMPTS))
    checker.attach(pipeline)
    checker.compare()
    with trio.fail_after(10_000):
        result = await pipeline.run()
    return checker, scorer, result.shortfall


def _permanent(checker: Conformance) -> list[Action]:
    return [a for a in checker.trace if a.kind is ActionKind.SCORE_FAIL and a.detail]


async def _check_permanent_run(design: str) -> None:
    """The groups of the failing calls are given up, nothing is retried, and the model allows
    every action the run took (the permanent variant is reached)."""
    checker, scorer, shortfall = await _checked_run(design, lambda: IndexError("vocab too small"))
    checker.raise_if_failed()
    called = [g for c in scorer.calls for g in c.group_ids]
    assert len(called) == len(set(called)), "no group is called twice: nothing is retried"
    failed = [c for c in scorer.calls if not c.ok]
    assert len(failed) == 2 and len(shortfall) == sum(len(c.group_ids) for c in failed)
    assert not any(a.detail == "retry" for a in checker.trace if a.kind is ActionKind.DISPATCH)
    assert _permanent(checker) == [Action(ActionKind.SCORE_FAIL, lane=0, detail="permanent")] * 2


@pytest.mark.parametrize("design", ["pump", "inline"])
async def test_a_run_with_permanent_failures_conforms(
    autojump_clock: trio.testing.MockClock, design: str
) -> None:
    await _check_permanent_run(design)


@pytest.mark.parametrize("design", ["pump", "inline"])
async def test_a_run_with_transient_failures_retries_and_conforms(
    autojump_clock: trio.testing.MockClock, design: str
) -> None:
    checker, scorer, shortfall = await _checked_run(
        design, lambda: ConnectionError("reset"), failing=frozenset({0})
    )
    checker.raise_if_failed()
    assert _permanent(checker) == [] and not shortfall
    called = [g for c in scorer.calls for g in c.group_ids]
    assert len(called) > len(set(called)), "the failed call's groups were called again"


@pytest.mark.parametrize(
    ("design", "module"),
    [("pump", stage_module), ("inline", inline_module)],
    ids=["pump", "inline"],
)
async def test_seeded_bug_a_design_that_retries_everything_is_caught(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    design: str,
    module: object,
) -> None:
    """Seeded bug: the stage, or the inline baseline, calls every error transient (the old
    behaviour). The run still conforms (a failure reported as transient may be retried), but
    the check of what was retried fails."""
    monkeypatch.setattr(module, "is_transient", lambda error, transient_errors: True)
    with pytest.raises(AssertionError, match="nothing is retried"):
        await _check_permanent_run(design)


async def test_seeded_bug_a_model_that_ignores_permanence_fails_conformance(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug in the model: `_score_fail` ignores the detail and retries a permanent
    failure's groups. The pipeline gave them up: the states differ at that action."""
    original = transitions._HANDLERS[ActionKind.SCORE_FAIL]

    def ignores_detail(
        s: scheduler.SchedState, b: scheduler.Bounds, a: Action
    ) -> scheduler.SchedState:
        return original(s, b, a._replace(detail=""))

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.SCORE_FAIL, ignores_detail)
    checker, _, _ = await _checked_run("pump", lambda: IndexError("vocab too small"))
    with pytest.raises(ConformanceError, match="permanent error") as info:
        checker.raise_if_failed()
    assert "the live state differs from the model's" in str(info.value)


def test_the_permanent_detail_is_one_constant() -> None:
    assert PERMANENT_FAILURE == "permanent"
    assert scheduler.PERMANENT_FAILURE is PERMANENT_FAILURE
