"""End to end beyond one machine, on one: the real pipeline with its teacher as a Ray worker
group and its rows in TransferQueue, and one teacher actor killed mid-run. The stage's failure
policy handles it: with restarts the run goes on and trains every prompt; with the teacher
reported lost, or the failure policy `fail`, the run fails cleanly. Either way no row is left
in the store that no group owns, and no padding row at all.

One local Ray for the module (TransferQueue's controller and storage unit, and two teacher
actors of half a CPU). Skipped without the `ray` and `tq` extras.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from groupflow.impl._core import keep_ray_local

keep_ray_local()
ray = pytest.importorskip("ray", reason="needs the ray and tq extras: pip install -e '.[ray,tq]'")
pytest.importorskip("transfer_queue", reason="needs the tq extra: pip install -e '.[ray,tq]'")

import trio  # noqa: E402

from groupflow.impl import (  # noqa: E402
    PipelineConfig,
    RaySettings,
    RayTeacherConfig,
    RayTeacherGroup,
    ScoringConfig,
    TeacherScorer,
    ThreadedScorer,
    ray_session,
)
from groupflow.impl._core import PAD_PREFIX, RaySession  # noqa: E402
from groupflow.impl._core._tq_store import TransferQueueStore  # noqa: E402
from groupflow.impl._pipeline import Pipeline, RunResult, build_pipeline  # noqa: E402
from groupflow.impl.contract import GenerateRequest  # noqa: E402
from groupflow.impl.errors import PumpFailed, ScorerLost, ScoringCallFailed  # noqa: E402
from groupflow.impl.testing import FakeLearner  # noqa: E402
from groupflow.model import LIVE_STATES, assert_invariants  # noqa: E402
from tests.helpers import STEP_OF_FOUR, run_doing  # noqa: E402
from tests.ray_fakes import ConstantTeacher  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.tq]

PROMPTS = 8
CALL_S = 1.0
"""Each teacher call takes this long, so a kill at `KILL_AT_S` lands mid-call."""
KILL_AT_S = 0.5


@pytest.fixture(scope="module")
def session() -> Iterator[RaySession]:
    with ray_session(RaySettings(num_cpus=4)) as opened:
        yield opened


@pytest.fixture(scope="module")
def owner(session: RaySession) -> Iterator[TransferQueueStore]:
    with TransferQueueStore.open(timeout_s=30) as store:
        yield store


@pytest.fixture
def store(owner: TransferQueueStore) -> TransferQueueStore:
    return TransferQueueStore.open(partition=f"e2e-{uuid.uuid4().hex[:8]}", timeout_s=30)


class TokenGenerator:
    """Rows a teacher can score: six tokens, a prompt of two."""

    fields = frozenset({"input_ids", "prompt_length", "generation_logprobs"})

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        await trio.sleep(0.01)
        return [
            {
                "input_ids": [request.ordinal % 200, i, 3, 4, 5, 6],
                "prompt_length": 2,
                "generation_logprobs": [-1.0] * 4,
            }
            for i in range(request.num_generations)
        ]

    async def sync_weights(self, version: int) -> None:
        pass


def _pipeline(store: TransferQueueStore, group: RayTeacherGroup, policy: str) -> Pipeline:
    config = PipelineConfig(
        shape=STEP_OF_FOUR.evolve(max_batch_groups=4),
        shutdown_timeout_s=30,
        scoring=ScoringConfig(flush_after_s=0.05, call_timeout_s=20, failure_policy=policy),
    )
    return build_pipeline(
        config,
        prompts=list(range(PROMPTS)),
        generator=TokenGenerator(),
        learner=FakeLearner(latency=0.01),
        scorer=ThreadedScorer(TeacherScorer({"teacher": group})),
        store=store,
        train_fields=["input_ids", "generation_logprobs"],
    )


async def _run_with_a_kill(
    store: TransferQueueStore, policy: str, **group_config: Any
) -> tuple[Pipeline, RayTeacherGroup, RunResult | BaseException]:
    """Run the pipeline; `KILL_AT_S` in (mid-call), kill DP rank 1's actor with `ray.kill`."""
    config = RayTeacherConfig(
        dp_size=2, num_cpus_per_actor=0.5, call_timeout_s=20, name="teacher", **group_config
    )
    make = functools.partial(ConstantTeacher, delay_s=CALL_S)
    group = await trio.to_thread.run_sync(RayTeacherGroup.start, make, config)
    pipeline = _pipeline(store, group, policy)
    try:
        outcome = await run_doing(
            pipeline, KILL_AT_S, lambda: ray.kill(group.actor(1)), bound_s=120
        )
    finally:
        await trio.to_thread.run_sync(group.close)
    return pipeline, group, outcome


async def _assert_no_row_leaked(pipeline: Pipeline, store: TransferQueueStore) -> None:
    """The store holds the rows of the groups the buffer still holds, and nothing else."""
    ids = await trio.to_thread.run_sync(store.list_ids)
    owned = {
        sid for g in pipeline.buffer.groups() if g.state in LIVE_STATES for sid in g.sample_ids
    }
    assert not [sid for sid in ids if sid.startswith(PAD_PREFIX)], "padding rows left"
    assert ids == owned, f"rows no group owns: {sorted(ids - owned)[:8]}"
    snapshot = await trio.to_thread.run_sync(pipeline.buffer.snapshot)
    assert_invariants(snapshot)
    await trio.to_thread.run_sync(lambda: store.clear(ids))


async def test_a_killed_actor_is_restarted_and_the_run_trains_every_prompt(
    store: TransferQueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline, group, outcome = await _run_with_a_kill(store, "retry")
    assert isinstance(outcome, RunResult), outcome
    assert outcome.trained == frozenset(range(PROMPTS)) and not outcome.shortfall
    assert group.restarts == 1
    assert any(
        "DP rank 1 died" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records
    ), "the stage did not see the death as a failed call it retries"
    await _assert_no_row_leaked(pipeline, store)


async def test_a_lost_teacher_fails_the_run_cleanly(store: TransferQueueStore) -> None:
    pipeline, group, outcome = await _run_with_a_kill(store, "retry", on_actor_loss="lost")
    assert isinstance(outcome, PumpFailed), outcome
    assert isinstance(outcome.__cause__, ScorerLost), repr(outcome.__cause__)
    assert group.lost is not None and "DP rank 1" in group.lost
    await _assert_no_row_leaked(pipeline, store)


async def test_failure_policy_fail_fails_the_run_on_the_kill(
    store: TransferQueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline, group, outcome = await _run_with_a_kill(store, "fail")
    assert isinstance(outcome, PumpFailed), outcome
    assert isinstance(outcome.__cause__, ScoringCallFailed), repr(outcome.__cause__)
    assert any(
        "TransientError" in r.getMessage()
        and "DP rank 1 died" in r.getMessage()
        and "failure_policy='fail'" in r.getMessage()
        for r in caplog.records
    ), "the run did not fail on the death"
    assert group.restarts == 1  # the group restarted the actor; the policy failed the run
    await _assert_no_row_leaked(pipeline, store)


async def test_seeded_bug_a_death_reported_as_permanent_is_caught(
    store: TransferQueueStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the death raised as a permanent error, the stage gives the killed call's groups
    up instead of retrying them: the restart test above fails."""
    from groupflow.impl._teachers import _ray as ray_module
    from groupflow.model.errors import TeacherOutputError

    monkeypatch.setattr(ray_module, "TransientError", TeacherOutputError)
    with pytest.raises(AssertionError):
        await test_a_killed_actor_is_restarted_and_the_run_trains_every_prompt(store, caplog)
