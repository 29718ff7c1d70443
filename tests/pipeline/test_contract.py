"""The contract with a user's own generator, learner and scorer: each mistake that used to pass
silently is refused when the pipeline is built (or at the commit that shows it), named; and
each refusal is shown to matter by a seeded bug that turns it off."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl import (
    TEACHER_FIELD,
    CheckpointConfig,
    GenerateRequest,
    PipelineConfig,
    ScoreRequest,
    ScoringConfig,
    TrainBatch,
    build_pipeline,
    load_checkpoint,
    teacher_by_agent,
)
from groupflow.impl._pipeline import Pipeline, RunResult, digest_data
from groupflow.impl.errors import (
    ArgumentError,
    CheckpointExists,
    CheckpointMismatch,
    ConfigError,
    RoutingError,
)
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model.shape import Shape
from tests.helpers import HANG_S

PROMPTS = 8


def config(**overrides: Any) -> PipelineConfig:
    shape = Shape(max_inflight_prompts=4, max_buffered_groups=8)
    return PipelineConfig(shape=shape, **overrides)


def saving(folder: Path) -> CheckpointConfig:
    """A checkpoint after every step, written inline (a thread's real time: the clock jumps)."""
    return CheckpointConfig(folder, every_steps=1, write_in_thread=False)


def scoring() -> ScoringConfig:
    return ScoringConfig(flush_after_s=1.0)


def make(**kwargs: Any) -> Pipeline:
    kwargs.setdefault("prompts", list(range(PROMPTS)))
    kwargs.setdefault("generator", FakeGenerator())
    kwargs.setdefault("learner", FakeLearner())
    kwargs.setdefault("train_fields", ["input_ids"])
    return build_pipeline(kwargs.pop("config", config()), **kwargs)


async def run(p: Pipeline) -> RunResult:
    with trio.fail_after(HANG_S):
        return await p.run()


@attrs.define
class StatelessLearner:
    """A learner with nothing to save (a frozen policy evaluated, say)."""

    steps: int = 0

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        self.steps += 1
        return {}


@attrs.define
class TeachersScorer:
    """A fake scorer that says which teachers it serves and what it reads."""

    teachers: frozenset[str]
    reads: frozenset[str] = frozenset()
    inner: FakeScorer = attrs.field(factory=lambda: FakeScorer(fixed=1.0))

    async def score(self, request: ScoreRequest) -> None:
        await self.inner.score(request)


# -- the learner's state ------------------------------------------------------------------


def test_a_learner_without_state_is_refused_unless_it_says_so() -> None:
    with pytest.raises(ConfigError, match=r"StatelessLearner has no state_dict or load_state"):
        make(learner=StatelessLearner())
    make(learner=StatelessLearner(), stateless_learner=True)


def test_a_stateful_learner_cannot_claim_to_be_stateless() -> None:
    with pytest.raises(ConfigError, match=r"stateless_learner=True, but learner FakeLearner"):
        make(stateless_learner=True)


async def _saved_run(tmp: Path, **kwargs: Any) -> Path:
    """A whole run that checkpoints after every step; its folder."""
    p = make(config=config(checkpoints=saving(tmp)), **kwargs)
    await run(p)
    return tmp


async def test_resume_without_learner_state_is_refused_unless_opted_out(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    saved = load_checkpoint(
        await _saved_run(tmp_path / "a", learner=StatelessLearner(), stateless_learner=True)
    )
    assert saved.learner is None
    stateful = make(config=config(checkpoints=saving(tmp_path / "b")))
    with pytest.raises(CheckpointMismatch, match=r"learner_state: saved 'none', now 'saved'"):
        await stateful.resume_from(saved)
    opted_out = make(
        config=config(checkpoints=saving(tmp_path / "c")),
        learner=StatelessLearner(),
        stateless_learner=True,
    )
    await opted_out.resume_from(saved)


async def test_resume_restores_the_learner(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    saved = load_checkpoint(await _saved_run(tmp_path / "a"))
    learner = FakeLearner()
    p = make(config=config(checkpoints=saving(tmp_path / "b")), learner=learner)
    await p.resume_from(saved)
    assert learner.steps == PROMPTS // 2 == saved.step


# -- the generator: weight sync and what it returns ------------------------------------


def test_a_generator_without_sync_weights_is_refused() -> None:
    @attrs.define
    class OldGenerator:
        async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
            return [{"input_ids": [1]}] * request.num_generations

    with pytest.raises(ConfigError, match=r"generator OldGenerator has no sync_weights\(\)"):
        make(generator=OldGenerator())


@attrs.define
class SlowSync(FakeGenerator):
    """Loading new weights takes 0.5 s, and must happen before the version moves."""

    pipeline: Pipeline | None = None
    seen: list[tuple[int, int]] = attrs.field(factory=list)

    async def sync_weights(self, version: int) -> None:
        assert self.pipeline is not None
        self.seen.append((version, self.pipeline.position.weight_version))
        await trio.sleep(0.5)
        await super().sync_weights(version)


async def test_sync_weights_is_awaited_after_each_step_before_the_version_moves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    generator = SlowSync()
    p = make(generator=generator)
    generator.pipeline = p
    result = await run(p)
    steps = PROMPTS // 2
    assert generator.synced == list(range(1, steps + 1))
    assert generator.seen == [(v, v - 1) for v in range(1, steps + 1)]
    assert [s.sync_s for s in result.steps] == [0.5] * steps
    assert all(s.train_s >= s.sync_s for s in result.steps)


async def test_a_row_without_a_field_the_learner_reads_is_a_failed_rollout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    @attrs.define
    class ForgetsAField(FakeGenerator):
        async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
            rows = await super().generate(request)
            if request.ordinal == 3:
                return [{"input_ids": [3]}, {"generation_logprobs": [-1.0]}]
            return rows

    p = make(generator=ForgetsAField(), train_fields=["input_ids", "generation_logprobs"])
    with caplog.at_level(logging.WARNING, logger="groupflow.rollout"):
        result = await run(p)
    assert result.shortfall == {3}
    assert "generator row 0 of prompt 3 lacks ['generation_logprobs']" in caplog.text
    assert not p.buffer.store.list_ids()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([{"input_ids": [1]}], "returned 1 rows for prompt 0; num_generations_per_prompt is 2"),
        ("ab", "returned a str for prompt 0"),
        ([{"input_ids": [1]}, ["input_ids"]], "row 1 of prompt 0 is a list, not a mapping"),
    ],
)
async def test_a_malformed_group_is_a_failed_rollout_naming_it(
    returned: object,
    message: str,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @attrs.define
    class Malformed(FakeGenerator):
        async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
            rows = await super().generate(request)
            return returned if request.ordinal == 0 else rows  # type: ignore[return-value]

    with caplog.at_level(logging.WARNING, logger="groupflow.rollout"):
        result = await run(make(generator=Malformed()))
    assert result.shortfall == {0}
    assert message in caplog.text


def test_fields_nothing_writes_are_refused_at_build() -> None:
    with pytest.raises(ConfigError, match=r"the learner reads \['prompt_length'\], which gen"):
        make(train_fields=["input_ids", "prompt_length"])
    with pytest.raises(ConfigError, match=r"scorer TeachersScorer reads \['prompt_length'\]"):
        make(
            config=config(scoring=scoring()),
            scorer=TeachersScorer(
                frozenset({"teacher"}), frozenset({"input_ids", "prompt_length"})
            ),
        )


# -- what the learner sees ----------------------------------------------------------------


async def test_by_default_the_learner_reads_every_field_the_generator_writes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    learner = FakeLearner()
    await run(
        make(
            config=config(scoring=scoring()),
            scorer=FakeScorer(fixed=1.0),
            learner=learner,
            train_fields=None,
        )
    )
    row = next(iter(learner.batches[0].rows.values()))
    assert set(row) == {"input_ids", "generation_logprobs", TEACHER_FIELD}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ([], "train_fields is empty"),
        ([TEACHER_FIELD], "train_fields is empty"),
        ("input_ids", "is one string"),
    ],
)
def test_a_learner_that_would_read_nothing_is_refused(fields: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(train_fields=fields, config=config(scoring=scoring()), scorer=FakeScorer())


def test_without_train_fields_the_generator_must_declare_its_own() -> None:
    @attrs.define
    class Undeclared(FakeGenerator):
        fields: Any = None

    with pytest.raises(ConfigError, match=r"train_fields is not given and generator Undec"):
        make(generator=Undeclared(), train_fields=None)


# -- empty steps ---------------------------------------------------------------------------


async def test_a_step_whose_prompts_were_all_given_up_is_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    generator = FakeGenerator(fail=frozenset({2, 3, 5}))
    learner = FakeLearner()
    result = await run(make(generator=generator, learner=learner))
    assert [s.skipped for s in result.steps] == [False, True, False, False]
    assert [b.step for b in learner.batches] == [0, 2, 3]
    assert [b.given_up for b in learner.batches] == [(), (5,), ()]
    assert all(b.groups for b in learner.batches)
    assert generator.synced == [1, 3, 4], "no weight sync after a skipped step"
    assert result.shortfall == {2, 3, 5}


# -- routes ------------------------------------------------------------------------------


def test_the_default_route_to_a_teacher_the_scorer_lacks_is_refused_at_build() -> None:
    with pytest.raises(RoutingError, match=r"to teacher 'teacher', which scorer TeachersScorer"):
        make(config=config(scoring=scoring()), scorer=TeachersScorer(frozenset({"t-math"})))


def test_an_agent_no_teacher_serves_is_refused_at_build() -> None:
    with pytest.raises(RoutingError, match=r"no teacher for prompt 1's agent 'code'"):
        make(
            config=config(scoring=scoring()),
            scorer=TeachersScorer(frozenset({"t-math"})),
            route=teacher_by_agent({"math": "t-math"}),
            agent_of=lambda o: "code" if o % 2 else "math",
        )


async def test_routes_to_served_teachers_run(autojump_clock: trio.testing.MockClock) -> None:
    scorer = TeachersScorer(frozenset({"t-math", "t-code"}))
    p = make(
        config=config(scoring=scoring()),
        scorer=scorer,
        route=teacher_by_agent({"math": "t-math", "code": "t-code"}),
        agent_of=lambda o: "code" if o % 2 else "math",
    )
    assert p.fingerprint["routes"] == {"code": "t-code", "math": "t-math"}
    result = await run(p)
    assert result.trained == set(range(PROMPTS))
    assert {c.teacher for c in scorer.inner.calls} == {"t-math", "t-code"}


# -- resuming on other data, and from an older checkpoint ------------------------------


async def _checkpoint(tmp: Path, **kwargs: Any) -> Path:
    return await _saved_run(tmp, **kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompts": list(range(1, PROMPTS + 1))}, r"data: another digest \(the prompts"),
        ({"agent_of": lambda o: "code"}, r"data: another digest"),
        (
            {"route": teacher_by_agent({"math": "t2", "code": "t2"})},
            r"agent 'math' saved 't1', now 't2'",
        ),
    ],
)
async def test_resume_on_other_data_or_routing_is_refused(
    change: dict[str, Any], message: str, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    base: dict[str, Any] = {
        "scorer": FakeScorer(fixed=1.0),
        "route": teacher_by_agent({"math": "t1", "code": "t2"}),
        "agent_of": lambda o: "math",
    }
    p = make(config=config(checkpoints=saving(tmp_path / "a"), scoring=scoring()), **base)
    await run(p)
    saved = load_checkpoint(tmp_path / "a")
    other = make(
        config=config(checkpoints=saving(tmp_path / "b"), scoring=scoring()),
        **{**base, **change, "scorer": FakeScorer()},
    )
    with pytest.raises(CheckpointMismatch, match=message):
        await other.resume_from(saved)


async def test_a_user_digest_stands_for_data_groupflow_cannot_read(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    opaque = [object() for _ in range(PROMPTS)]
    with pytest.raises(ArgumentError, match=r"prompt 0 is a object.*pass data_digest="):
        make(prompts=opaque)
    with pytest.raises(ConfigError, match=r"data_digest='' must be a non-empty string"):
        make(prompts=opaque, data_digest="")
    await _saved_run(tmp_path / "a", prompts=opaque, data_digest="shard-7@v3")
    saved = load_checkpoint(tmp_path / "a")
    again = make(
        config=config(checkpoints=saving(tmp_path / "b")),
        prompts=opaque,
        data_digest="shard-7@v3",
    )
    await again.resume_from(saved)
    changed = make(prompts=opaque, data_digest="shard-7@v4")
    with pytest.raises(CheckpointMismatch, match="data: another digest"):
        await changed.resume_from(saved)


def test_the_data_digest_sees_values_and_types_not_dict_order() -> None:
    base = digest_data([{"a": 1, "b": [1, 2]}, "x"], [None, "math"])
    assert base == digest_data([{"b": [1, 2], "a": 1}, "x"], [None, "math"])
    for other in (
        ([{"a": 1, "b": [1, 2]}, "y"], [None, "math"]),
        ([{"a": 1, "b": [2, 1]}, "x"], [None, "math"]),
        ([{"a": 1.0, "b": [1, 2]}, "x"], [None, "math"]),
        ([{"a": True, "b": [1, 2]}, "x"], [None, "math"]),
        ([{"a": "1", "b": [1, 2]}, "x"], [None, "math"]),
        ([{"a": 1, "b": [1, 2]}, "x"], ["math", None]),
        ([{"a": 1, "b": (1, 2)}, ["x"]], [None, "math"]),
    ):
        assert digest_data(*other) != base, other


@attrs.frozen
class _DigestItem:
    ordinal: int
    domain: str
    tokens: tuple[int, ...]
    answer: tuple[int, ...]


class _Tensorish:
    dtype = "int64"

    def tolist(self) -> list[list[int]]:
        return [[1, 2], [3, 4]]


def test_the_data_digest_does_not_change_across_versions() -> None:
    """The digest is saved in checkpoints: the same data must give the same digest in every
    groupflow version, or a resume after an upgrade is refused (values pinned at 0.1.0)."""
    data = [
        _DigestItem(0, "count", (1, 2, 3, 4, 5), (6, 7)),
        _DigestItem(1, "reverse", (1, 3, 250, 17, 9000), ()),
        {"b": [1.5, -0.0, float("inf"), float("nan")], "a": None, 3: True, "c": False},
        ("x", b"raw", bytearray(b"ba"), -12, 2**70, "\ud800"),
        _Tensorish(),
        [],
    ]
    agents = [None, "count", "reverse", None, "t", ""]
    assert digest_data(data, agents) == DIGEST_MIXED
    many = [_DigestItem(i, "count", (i, i + 1, 255), (i % 7,)) for i in range(50)]
    assert digest_data(many, ["count"] * 50) == DIGEST_ITEMS


DIGEST_MIXED = "f9b5294bce491cadd4a4c9cb302fdfb3a92b6404c44101137b7a8cfa3c998fbb"
DIGEST_ITEMS = "0632a8ae6dbb4993824d34818ba92fefd3eb48072a148c661b097671420140f3"


async def test_resume_from_an_older_checkpoint_moves_the_newer_ones_aside(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    await _saved_run(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == [f"step-{s:06d}" for s in range(1, 5)]
    older = load_checkpoint(tmp_path / "step-000002")
    learner = FakeLearner()
    p = make(config=config(checkpoints=saving(tmp_path)), learner=learner)
    with caplog.at_level(logging.WARNING, logger="groupflow.checkpoint"):
        await p.resume_from(older)
    assert "moved step-000003, step-000004 aside" in caplog.text
    (aside,) = tmp_path.glob("rolled-back-from-step-000002-*")
    assert sorted(q.name for q in aside.iterdir()) == ["step-000003", "step-000004"]
    assert load_checkpoint(tmp_path).step == 2, "latest names the checkpoint resumed from"
    result = await run(p)
    assert result.trained == set(range(PROMPTS))
    assert [b.step for b in learner.batches] == [2, 3]
    assert load_checkpoint(tmp_path).step == 4


async def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_before_it_starts(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    await _saved_run(tmp_path)
    generator = FakeGenerator()
    p = make(config=config(checkpoints=saving(tmp_path)), generator=generator)
    with pytest.raises(CheckpointExists, match=r"already holds checkpoints \(newest step-000004\)"):
        await run(p)
    assert generator.most_running == 0, "nothing ran"


# -- seeded bugs: each check above, turned off, lets the silent failure through -----------


async def test_seeded_bug_a_fingerprint_blind_to_the_data(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the digest constant (sizes only, as before), a resume on other prompts of the same
    number is accepted: the test above that expects a refusal would fail."""
    import groupflow.impl._pipeline._build as build

    monkeypatch.setattr(build, "digest_data", lambda prompts, agents: "sizes only")
    await _saved_run(tmp_path / "a")
    other = make(
        config=config(checkpoints=saving(tmp_path / "b")),
        prompts=[p + 100 for p in range(PROMPTS)],
    )
    await other.resume_from(load_checkpoint(tmp_path / "a"))  # silently accepted


def test_seeded_bug_routes_not_checked_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the build-time route check, the default route to a missing teacher builds."""
    import groupflow.impl._pipeline._build as build

    monkeypatch.setattr(build, "routes_for", lambda route, agents, **kw: {})
    make(config=config(scoring=scoring()), scorer=TeachersScorer(frozenset({"t-math"})))


async def test_seeded_bug_resume_that_ignores_the_missing_learner_state(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old behaviour: no learner state in the checkpoint, the learner left as built. The
    fingerprint is what refuses it; with that check gone the learner resumes from zero steps
    while the ledger says four were trained."""
    import groupflow.impl._pipeline._controller as controller

    saved = load_checkpoint(
        await _saved_run(tmp_path / "a", learner=StatelessLearner(), stateless_learner=True)
    )
    monkeypatch.setattr(controller, "check_fingerprint", lambda saved, current, path: None)
    monkeypatch.setattr(FakeLearner, "load_state_dict", lambda self, state: None)
    learner = FakeLearner()
    p = make(config=config(checkpoints=saving(tmp_path / "b")), learner=learner)
    await p.resume_from(saved)
    assert learner.steps == 0 and len(saved.ledger["trained"]) == PROMPTS


async def test_seeded_bug_no_check_of_generated_rows(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the commit check, a row without the learner's field is committed (a stage owes
    the group its teacher field, so the buffer cannot refuse it yet) and the run goes wrong
    later (the old failure mode), instead of one failed rollout per bad group."""
    import groupflow.impl._pipeline._rollout as rollout

    monkeypatch.setattr(
        rollout, "check_generations", lambda ordinal, rows, *, expected, needs: list(rows)
    )

    @attrs.define
    class ForgetsAField(FakeGenerator):
        async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
            return [{"generation_logprobs": [-1.0]}] * request.num_generations

    p = make(
        generator=ForgetsAField(),
        config=config(scoring=scoring()),
        scorer=FakeScorer(fixed=1.0),
    )
    with pytest.raises(trio.TooSlowError):  # the group went back to WRITTEN: nobody owns it
        await run(p)


async def test_seeded_bug_rollback_without_moving_newer_checkpoints_aside(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old behaviour: a resume from step 2 trains, then fails saving step 3, which exists."""
    import groupflow.impl._pipeline._controller as controller

    monkeypatch.setattr(controller, "set_aside_newer", lambda directory, step, keep: None)
    await _saved_run(tmp_path)
    p = make(config=config(checkpoints=saving(tmp_path)))
    await p.resume_from(load_checkpoint(tmp_path / "step-000002"))
    with pytest.raises(BaseException) as caught:
        await run(p)
    assert "step-000003 already exists" in repr(caught.value) + repr(caught.value.__cause__)


@pytest.mark.parametrize("name", ["Generator", "Learner", "Scorer", "Teacher"])
def test_help_on_each_protocol_says_what_to_implement_with_an_example(name: str) -> None:
    import groupflow.impl

    doc = getattr(groupflow.impl, name).__doc__ or ""
    assert "Example" in doc and "def " in doc, name
