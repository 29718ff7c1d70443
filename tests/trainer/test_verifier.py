"""The trainer's optional verifier stage (`reward_weight > 0`, `--reward-weight`): a second
scoring stage after the teacher's writes each response's reward, the learner mixes it into the
advantage, and the run's trace replays valid against the two-stage model, across a crash.

Seeded bugs, each caught by the test named after it: a verifier that rewards every response;
a learner that ignores the verifier's field and rewards by its own count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install '.[train]')")

import trio  # noqa: E402

from groupflow.impl import MemoryStore, ScoreRequest, TorchTeacher  # noqa: E402
from groupflow.impl._pipeline import Pipeline  # noqa: E402
from groupflow.impl._trainer import PROMPT_LENGTH, RunFolder, TrainConfig, make_prompts  # noqa: E402
from groupflow.impl._trainer import _verifier as verifier_module  # noqa: E402
from groupflow.impl._trainer._learner import DistillLearner  # noqa: E402
from groupflow.impl._trainer._provision import DomainTeacher  # noqa: E402
from groupflow.impl._trainer._run import train  # noqa: E402
from groupflow.impl._trainer._student import new_student, student_config  # noqa: E402
from groupflow.impl.contract import TrainBatch  # noqa: E402
from groupflow.model import GroupState, GroupView  # noqa: E402
from groupflow.model.errors import ConfigError  # noqa: E402
from groupflow.sim.verify.replay import bounds_of_header, replay  # noqa: E402
from tests.helpers import TINY_TRAIN  # noqa: E402

TINY = {**TINY_TRAIN, "reward_weight": 0.5}


def _teachers(config: TrainConfig) -> dict[str, DomainTeacher]:
    cfg = student_config(d_model=32, n_layers=1)
    return {
        d: DomainTeacher(f"{d}-teacher", TorchTeacher(new_student(cfg, seed=60 + i), device="cpu"))
        for i, d in enumerate(config.domains)
    }


def _run(config: TrainConfig, out: Path, *, resume: bool = False, **kw: Any) -> Any:
    async def main() -> Any:
        with trio.fail_after(300):
            return await train(
                RunFolder.resume(out, config) if resume else RunFolder.new(out, config),
                teachers=_teachers(config),
                device="cpu",
                progress=None,
                say=lambda s: None,
                plot=False,
                **kw,
            )

    return trio.run(main)


async def _verify(prompts: Any, responses: dict[str, list[int]]) -> dict[str, float]:
    """The verifier's rewards for one group whose rows answer `responses`."""
    store = MemoryStore()
    store.put({sid: {"input_ids": ids} for sid, ids in responses.items()})
    group = GroupView("g0", GroupState.SCORING, 0, tuple(responses), ordinal=0)
    request = ScoreRequest(verifier_module.VERIFIER, (group,), store, "reward")
    await verifier_module.Verifier(prompts).score(request)
    return {sid: row["reward"] for sid, row in store.get(list(responses), ["reward"]).items()}


async def test_the_verifier_rewards_right_answers_only() -> None:
    prompts = make_prompts(1, domains=("count",), seed=3)
    prompt = prompts[0]
    right = list(prompt.tokens) + list(prompt.answer)
    wrong = list(prompt.tokens) + [(t + 1) % 7 for t in prompt.answer]
    assert right[PROMPT_LENGTH:] != wrong[PROMPT_LENGTH:]
    assert await _verify(prompts, {"r": right, "w": wrong}) == {"r": 1.0, "w": 0.0}


def test_a_run_with_the_verifier_trains_through_two_stages_and_replays_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import groupflow.impl._trainer._run as run_module

    built: list[Pipeline] = []
    original = run_module.build_pipeline  # type: ignore[attr-defined]

    def recording(*args: Any, **kw: Any) -> Pipeline:
        built.append(original(*args, **kw))
        return built[-1]

    monkeypatch.setattr(run_module, "build_pipeline", recording)
    config = TrainConfig.from_mapping(TINY)
    _run(config, tmp_path / "run")
    (pipeline,) = built
    assert [s.name for s in pipeline.stages] == ["teacher", "verifier"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == config.steps
    assert all(0.0 <= line["reward"] <= 1.0 for line in lines)
    assert sum(line["verifier_groups"] for line in lines) == config.num_prompts
    header = json.loads((tmp_path / "run" / "trace.jsonl").read_text().splitlines()[0])
    assert header["stages"] == 2 and bounds_of_header(header).stages == 2
    verdict = replay(tmp_path / "run")
    assert verdict.verdict == "valid", verdict.problem
    assert verdict.trained == frozenset(range(config.num_prompts))


def test_without_a_reward_weight_there_is_no_verifier(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping({**TINY, "reward_weight": 0.0, "steps": 2})
    _run(config, tmp_path / "run")
    header = json.loads((tmp_path / "run" / "trace.jsonl").read_text().splitlines()[0])
    assert header["stages"] == 1
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward" not in line and "verifier_calls" not in line


@pytest.mark.parametrize("policy", ["flush", "uncommitted"])
def test_a_crash_and_resume_with_the_verifier_trains_every_prompt_once(
    tmp_path: Path, policy: str
) -> None:
    config = TrainConfig.from_mapping(
        {**TINY, "steps": 8, "checkpoints": {**TINY["checkpoints"], "policy": policy}}
    )
    out = tmp_path / "run"

    async def crash() -> None:
        with trio.fail_after(300), trio.CancelScope() as scope:

            def on_step(record: Any) -> None:
                if record.step + 1 >= 5:
                    scope.cancel()

            await train(
                RunFolder.new(out, config),
                teachers=_teachers(config),
                device="cpu",
                progress=None,
                on_step=on_step,
                say=lambda s: None,
                plot=False,
            )
        assert scope.cancelled_caught

    trio.run(crash)
    assert replay(out).verdict == "incomplete"
    second = _run(config, out, resume=True)
    assert second.steps == config.steps
    verdict = replay(out)
    assert verdict.verdict == "valid", verdict.problem
    assert verdict.trained == frozenset(range(config.num_prompts))


@pytest.mark.parametrize("weight", [-0.1, float("nan"), "1"])
def test_a_bad_reward_weight_is_refused_naming_the_field(weight: Any) -> None:
    with pytest.raises(ConfigError, match="TrainConfig.reward_weight"):
        TrainConfig(reward_weight=weight)


# -- the learner reads the verifier's reward, and seeded bugs ----------------------------------


def _batch_with_rewards(rewards: list[float]) -> tuple[DistillLearner, TrainBatch]:
    """A two-row batch whose rows carry the given verifier rewards (and teacher = generation,
    so the distillation part of the advantage is zero and only the reward moves it)."""
    prompts = make_prompts(1, domains=("count",), seed=1)
    prompt = prompts[0]
    ids = list(prompt.tokens) + list(prompt.answer)
    model = new_student(student_config(d_model=32, n_layers=1), seed=5)
    learner = DistillLearner(
        model, prompts, lr=1e-3, clip_low=0.5, clip_high=2.0, reward_weight=1.0
    )
    zeros = [0.0] * (len(ids) - PROMPT_LENGTH)
    rows = {
        f"g/{i}": {
            "input_ids": ids,
            "generation_logprobs": zeros,
            "weight_version": 0,
            "teacher_reference_logprobs": zeros,
            verifier_module.REWARD_FIELD: r,
        }
        for i, r in enumerate(rewards)
    }
    group = GroupView("g", GroupState.CONSUMED, 0, tuple(rows), ordinal=0)
    return learner, TrainBatch(0, 0, (group,), rows)


async def test_the_learner_takes_the_reward_from_the_verifiers_field() -> None:
    # both rows answer right, but the verifier said 0 for both: the advantage must be 0
    learner, batch = _batch_with_rewards([0.0, 0.0])
    stats = await learner.train_step(batch)
    assert stats["reward"] == 0.0 and stats["advantage"] == 0.0
    learner, batch = _batch_with_rewards([1.0, 0.0])
    stats = await learner.train_step(batch)
    assert stats["reward"] == 0.5 and stats["advantage"] == pytest.approx(0.5)


async def test_seeded_bug_learner_rewards_by_its_own_count_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the learner ignores the verifier's field and computes the reward itself
    (the code before the verifier stage existed)."""
    monkeypatch.setattr("groupflow.impl._trainer._learner.REWARD_FIELD", "accuracy_by_rule")
    learner, batch = _batch_with_rewards([0.0, 0.0])
    for row in batch.rows.values():
        row["accuracy_by_rule"] = 1.0  # type: ignore[index]
    stats = await learner.train_step(batch)
    with pytest.raises(AssertionError):
        assert stats["reward"] == 0.0 and stats["advantage"] == 0.0


async def test_seeded_bug_verifier_rewards_everything_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: a verifier that compares nothing (every response right)."""
    monkeypatch.setattr(
        verifier_module, "domain_of", lambda prompt: type("D", (), {"correct": lambda *a: True})
    )
    prompts = make_prompts(1, domains=("count",), seed=3)
    prompt = prompts[0]
    wrong = list(prompt.tokens) + [(t + 1) % 7 for t in prompt.answer]
    with pytest.raises(AssertionError):
        assert await _verify(prompts, {"w": wrong}) == {"w": 0.0}


def test_the_cli_refuses_a_bad_reward_weight_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from groupflow.cli import main

    code = main(["train", "--reward-weight", "-1", "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward_weight" in err[0] and "-1" in err[0], err
    assert not (tmp_path / "r").exists()
