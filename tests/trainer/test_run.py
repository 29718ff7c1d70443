"""The distillation trainer: its loss by hand, what flows where, a short run that learns, and
resumes (a stop and a crash at a random step) that train every prompt exactly once, judged by
replaying the run's own trace against the model."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install '.[train]')")

import trio  # noqa: E402

from groupflow.impl import TEACHER_FIELD, TorchTeacher  # noqa: E402
from groupflow.impl._pipeline import Pipeline, RolloutPump, ScoringStage, TrainPump  # noqa: E402
from groupflow.impl._trainer import PROMPT_LENGTH, RunFolder, TrainConfig, make_prompts  # noqa: E402
from groupflow.impl._trainer._domain_teachers import domain_teacher  # noqa: E402
from groupflow.impl._trainer._generator import StudentGenerator  # noqa: E402
from groupflow.impl._trainer._learner import DistillLearner, distill_loss  # noqa: E402
from groupflow.impl._trainer._provision import DomainTeacher  # noqa: E402
from groupflow.impl._trainer._run import train  # noqa: E402
from groupflow.impl._trainer._student import new_student, response_logprobs, sample, student_config  # noqa: E402
from groupflow.impl.contract import TrainBatch  # noqa: E402
from groupflow.model import GroupState, GroupView  # noqa: E402
from groupflow.model.errors import ConfigError, PumpFailed  # noqa: E402
from groupflow.sim.verify.replay import replay  # noqa: E402
from tests.helpers import ROOT, TINY_TRAIN  # noqa: E402

TINY = TINY_TRAIN


def _random_teachers(config: TrainConfig) -> dict[str, DomainTeacher]:
    cfg = student_config(d_model=32, n_layers=1)
    return {
        d: DomainTeacher(f"{d}-teacher", TorchTeacher(new_student(cfg, seed=50 + i), device="cpu"))
        for i, d in enumerate(config.domains)
    }


@pytest.fixture(scope="module")
def trained_teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DomainTeacher]:
    cache = tmp_path_factory.mktemp("teachers")
    return {
        d: DomainTeacher(f"{d}-teacher", domain_teacher(d, cache_dir=cache, device="cpu"))
        for d in ("count", "reverse")
    }


def _run(
    config: TrainConfig,
    out: Path,
    teachers: dict[str, DomainTeacher],
    *,
    resume: bool = False,
    **kw: Any,
) -> Any:
    async def main() -> Any:
        with trio.fail_after(300):
            return await train(
                RunFolder.resume(out, config) if resume else RunFolder.new(out, config),
                teachers=teachers,
                device="cpu",
                progress=None,
                **{"say": lambda s: None, **kw},
            )

    return trio.run(main)


# -- the loss ------------------------------------------------------------------------------


def _diverged(tmp_path: Path) -> str:
    """A run whose learning rate overshoots at once: the error it fails with, after checking
    that every metrics line it wrote is JSON (no NaN)."""
    config = TrainConfig.from_mapping({**TINY, "lr": 1e9})
    out = tmp_path / "run"
    with pytest.raises(PumpFailed) as failed:
        _run(config, out, _random_teachers(config))
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=_not_json)
    return repr(failed.value.__cause__)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} in metrics.jsonl")


def test_a_student_that_diverges_fails_the_run_naming_the_step_and_the_cure(
    tmp_path: Path,
) -> None:
    cause = _diverged(tmp_path)
    assert cause.startswith("LearnerDiverged(") and "the loss of train step" in cause, cause
    assert "smaller [train] lr than 1e+09" in cause, cause


def test_seeded_bug_a_nan_loss_trained_on_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug: the learner takes a step whatever its loss (as it did): the run trains on,
    its rollouts sampled from broken weights given up, and ends as if nothing happened."""
    from groupflow.impl._trainer import _learner

    monkeypatch.setattr(_learner, "_refuse_divergence", lambda loss, step, lr: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_a_student_that_diverges_fails_the_run_naming_the_step_and_the_cure(tmp_path)


def test_the_loss_against_a_hand_computed_example() -> None:
    _check_the_loss_by_hand()


def _check_the_loss_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    generation = torch.tensor([[-1.5, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0]])
    parts = distill_loss(logp, generation, teacher, clip_low=0.5, clip_high=2.0)
    # advantage: teacher - generation = [1.0, -2.0]; weights exp(logp - gen) = [e^0.5, e^-1],
    # truncated to [0.5, 2.0]: [1.6487, 0.5]
    assert parts.advantage.tolist() == [[1.0, -2.0]]
    assert parts.weight[0, 0].item() == pytest.approx(math.exp(0.5))
    assert parts.weight[0, 1].item() == pytest.approx(0.5)
    assert parts.clipped == 0.5
    want = -(math.exp(0.5) * 1.0 * -1.0 + 0.5 * -2.0 * -2.0) / 2
    assert parts.loss.item() == pytest.approx(want)
    parts.loss.backward()  # type: ignore[no-untyped-call]
    # d loss / d logp_t = -w_t * A_t / n: the weights and advantages carry no gradient
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(0.5) / 2, 0.5 * 2.0 / 2])


def _batch_of(prompts: list[Any], rows: list[dict[str, Any]], per_prompt: int) -> TrainBatch:
    groups, by_id = [], {}
    for i, prompt in enumerate(prompts):
        ids = tuple(f"g{i}/{j}" for j in range(per_prompt))
        groups.append(
            GroupView(
                group_id=f"g{i}",
                state=GroupState.CONSUMED,
                target_step=0,
                sample_ids=ids,
                fields=frozenset(),
                awaiting_stage=False,
                start_weight_version=0,
                end_weight_version=0,
                ordinal=prompt.ordinal,
                agent=prompt.domain,
            )
        )
        for j, sid in enumerate(ids):
            by_id[sid] = rows[i * per_prompt + j]
    return TrainBatch(0, 0, tuple(groups), by_id)


def _rows(model: Any, prompts: list[Any], teacher: Any, n: int) -> list[dict[str, Any]]:
    rows = []
    rng = torch.Generator().manual_seed(0)
    for prompt in prompts:
        responses, logprobs = sample(model, prompt.tokens, n, generator=rng)
        for response, lp in zip(responses, logprobs, strict=True):
            ids = torch.tensor([[*prompt.tokens, *response]])
            with torch.no_grad():
                teacher_lp = response_logprobs(teacher, ids)[0].tolist()
            rows.append(
                {
                    "input_ids": [*prompt.tokens, *response],
                    "generation_logprobs": lp,
                    TEACHER_FIELD: teacher_lp,
                    "weight_version": 0,
                }
            )
    return rows


def test_a_student_equal_to_its_teacher_has_zero_advantage_and_zero_gradient() -> None:
    model = new_student(student_config(d_model=32, n_layers=1), seed=3)
    prompts = make_prompts(4)
    rows = _rows(model, prompts, model, 3)
    learner = DistillLearner(model, prompts, lr=1e-3, clip_low=0.5, clip_high=2.0)
    ids = torch.tensor([r["input_ids"] for r in rows])
    parts = distill_loss(
        response_logprobs(model, ids),
        torch.tensor([r["generation_logprobs"] for r in rows]),
        torch.tensor([r[TEACHER_FIELD] for r in rows]),
        clip_low=0.5,
        clip_high=2.0,
    )
    assert parts.advantage.abs().max().item() < 1e-5
    parts.loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.abs().max().item() for p in model.parameters() if p.grad is not None]
    assert max(grads) < 1e-5
    # (no check that an optimizer step leaves the weights alone: Adam divides the float noise
    # of a zero gradient by its own scale)
    stats = trio.run(learner.train_step, _batch_of(prompts, rows, 3))
    assert abs(stats["kl"]) < 1e-5 and abs(stats["loss"]) < 1e-6


def test_gradients_reach_the_student_only() -> None:
    teacher_model = new_student(student_config(d_model=32, n_layers=1), seed=4)
    teacher = TorchTeacher(teacher_model, device="cpu")
    student = new_student(student_config(d_model=32, n_layers=1), seed=5)
    prompts = make_prompts(4)
    rows = _rows(student, prompts, teacher.model, 2)
    learner = DistillLearner(student, prompts, lr=1e-2, clip_low=0.5, clip_high=2.0)
    teacher_before = [p.detach().clone() for p in teacher.model.parameters()]
    student_before = [p.detach().clone() for p in student.parameters()]
    trio.run(learner.train_step, _batch_of(prompts, rows, 2))
    assert all(p.grad is None for p in teacher.model.parameters())
    assert all(
        torch.equal(a, b) for a, b in zip(teacher_before, teacher.model.parameters(), strict=True)
    )
    assert any(
        not torch.equal(a, b) for a, b in zip(student_before, student.parameters(), strict=True)
    )


# -- the generator -------------------------------------------------------------------------


def test_the_generator_samples_the_weights_it_was_synced_to() -> None:
    _check_the_refit()


def _check_the_refit() -> None:
    student = new_student(student_config(d_model=32, n_layers=1), seed=6)
    learner = DistillLearner(student, make_prompts(2), lr=1e-2, clip_low=0.5, clip_high=2.0)
    generator = StudentGenerator(learner.model, learner.weights, seed=0)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.1)
    differs = any(
        not torch.equal(a, b)
        for a, b in zip(generator.model.parameters(), learner.model.parameters(), strict=True)
    )
    assert differs, "the generator shares the learner's tensors: a refit would be a no-op"
    trio.run(generator.sync_weights, 7)
    assert generator.version == 7
    assert all(
        torch.equal(a, b)
        for a, b in zip(generator.model.parameters(), learner.model.parameters(), strict=True)
    )


# -- runs ----------------------------------------------------------------------------------


def test_a_bad_config_fails_before_any_model_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import groupflow.impl._trainer._run as run_module

    built: list[object] = []
    monkeypatch.setattr(run_module, "run_student", lambda *a, **kw: built.append(a))
    with pytest.raises(ConfigError, match="max_buffered_groups=1 is smaller than"):
        TrainConfig().evolve(max_buffered_groups=1)
    with pytest.raises(ConfigError, match="unknown \\[train\\] keys \\['stepz'\\]"):
        TrainConfig.from_mapping({"stepz": 3})
    assert not built


def test_a_short_run_writes_metrics_a_checkpoint_a_trace_and_curves(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping(TINY)
    summary = _run(config, tmp_path / "run", _random_teachers(config))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == config.steps
    assert all(math.isfinite(float(__import__("json").loads(line)["loss"])) for line in lines)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())
    assert summary.curves is not None and summary.curves.stat().st_size > 0
    assert (tmp_path / "run" / "summary.txt").read_text().startswith("run:")
    verdict = replay(tmp_path / "run")
    assert verdict.verdict == "valid", verdict.problem
    assert verdict.trained == frozenset(range(config.num_prompts))


def test_the_trainer_runs_the_controller_the_property_machines_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import groupflow.impl._trainer._run as run_module

    built: list[Pipeline] = []
    original = run_module.build_pipeline  # type: ignore[attr-defined]

    def recording(*args: Any, **kw: Any) -> Pipeline:
        pipeline = original(*args, **kw)
        built.append(pipeline)
        return pipeline

    monkeypatch.setattr(run_module, "build_pipeline", recording)
    config = TrainConfig.from_mapping({**TINY, "steps": 2})
    _run(config, tmp_path / "run", _random_teachers(config))
    (pipeline,) = built
    assert type(pipeline) is Pipeline
    assert type(pipeline.rollout) is RolloutPump and type(pipeline.train) is TrainPump
    assert type(pipeline.stage) is ScoringStage


@pytest.mark.timeout(600)  # with the module's teachers trained first, on a loaded machine
def test_a_short_run_learns(tmp_path: Path, trained_teachers: dict[str, DomainTeacher]) -> None:
    config = TrainConfig(
        steps=160, domains=("count",), checkpoints={"every_steps": 80}, eval_prompts=22
    )
    summary = _run(config, tmp_path / "run", {"count": trained_teachers["count"]})
    assert summary.kl_last < summary.kl_first - 1.0, (summary.kl_first, summary.kl_last)


@pytest.mark.parametrize("policy", ["flush", "uncommitted"])
@pytest.mark.parametrize("how", ["stop", "crash"])
def test_a_run_ended_at_a_random_step_and_resumed_trains_every_prompt_once(
    tmp_path: Path, policy: str, how: str
) -> None:
    config = TrainConfig.from_mapping(
        {**TINY, "steps": 8, "checkpoints": {**TINY["checkpoints"], "policy": policy}}
    )
    teachers = _random_teachers(config)
    out = tmp_path / "run"
    at = random.Random(f"{policy}{how}").randint(3, 6)
    if how == "stop":
        first = _run(config, out, teachers, stop_after=at)
        assert first.stopped_early and first.steps >= at
        assert replay(out).verdict == "incomplete"
    else:
        _crash_at(config, out, teachers, at)
        assert replay(out).verdict == "incomplete"
    second = _run(config, out, teachers, resume=True)
    assert second.steps == config.steps and not second.stopped_early
    verdict = replay(out)
    assert verdict.verdict == "valid", verdict.problem
    assert len(verdict.incarnations) == 2
    assert verdict.trained == frozenset(range(config.num_prompts))


def _crash_at(config: TrainConfig, out: Path, teachers: dict[str, DomainTeacher], at: int) -> None:
    """The process dies after step `at`: everything in memory is gone (the run is cancelled
    where it stands), what is on disk stays."""

    async def main() -> None:
        with trio.fail_after(300), trio.CancelScope() as scope:

            def on_step(record: Any) -> None:
                if record.step + 1 >= at:
                    scope.cancel()

            await train(
                RunFolder.new(out, config),
                teachers=teachers,
                device="cpu",
                progress=None,
                on_step=on_step,
            )
        assert scope.cancelled_caught

    trio.run(main)


def test_resume_refuses_other_settings(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping(TINY)
    teachers = _random_teachers(config)
    _run(config, tmp_path / "run", teachers, stop_after=2)
    with pytest.raises(ConfigError, match="other settings \\(\\['lr'\\]\\)"):
        _run(config.evolve(lr=1.0), tmp_path / "run", teachers, resume=True)
    with pytest.raises(ConfigError, match="already holds a run's checkpoints"):
        _run(config, tmp_path / "run", teachers)


def _finished_without_checkpoint(tmp_path: Path) -> Path:
    """A run that died before its first checkpoint: its folder holds the checkpoints' lock
    file and the run's trace, but no checkpoint."""
    config = TrainConfig.from_mapping(TINY)
    out = tmp_path / "run"
    _crash_at(config, out, _random_teachers(config), 1)
    assert not list((out / "checkpoints").glob("step-*")) and (out / "trace.jsonl").exists()
    return out


def _last_saved(tmp_path: Path) -> int:
    """The step of the newest checkpoint of a run of 5 steps, saved every 2."""
    config = TrainConfig.from_mapping({**TINY, "steps": 5})
    _run(config, tmp_path / "run", _random_teachers(config))
    return max(int(p.name.split("-")[1]) for p in (tmp_path / "run/checkpoints").glob("step-*"))


def test_a_run_saves_its_last_step(tmp_path: Path) -> None:
    """Its steps trained, a run saves the last one even where `every_steps` does not divide
    them: the trained student is never left out of the run folder."""
    assert _last_saved(tmp_path) == 5


def test_seeded_bug_the_last_step_left_unsaved_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug: only the steps `every_steps` divides are saved (the newest is step 4)."""
    from groupflow.impl._pipeline._train import TrainPump

    async def nothing(self: Any) -> None:
        if self.stop_requested:  # a stop still saves: only the natural end is broken
            await self.checkpointer.save()

    monkeypatch.setattr(TrainPump, "_save_last_step", nothing)
    with pytest.raises(AssertionError):
        test_a_run_saves_its_last_step(tmp_path)


def test_a_run_that_saved_no_checkpoint_is_a_folder_to_start_in_again(tmp_path: Path) -> None:
    """Nothing to resume from, so a new run starts there (afresh: `RunFolder.start` drops the
    old trace), whatever the lock file the old one left."""
    out = _finished_without_checkpoint(tmp_path)
    assert RunFolder.new(out, TrainConfig.from_mapping(TINY)).checkpoint is None


def test_seeded_bug_the_lock_file_taken_for_a_checkpoint_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug: any file in checkpoints/ (the lock) counts as a checkpoint (as it did):
    the new run is refused and told to resume a run that has nothing to resume from."""
    from groupflow.impl._trainer import _run_folder

    def anything(directory: Path) -> list[Path]:
        return list(directory.iterdir()) if directory.is_dir() else []

    monkeypatch.setattr(_run_folder, "step_folders", anything)
    with pytest.raises(ConfigError, match="already holds a run's checkpoints"):
        test_a_run_that_saved_no_checkpoint_is_a_folder_to_start_in_again(tmp_path)


def test_the_generator_rows_carry_the_prompt() -> None:
    model = new_student(student_config(d_model=32, n_layers=1), seed=1)
    generator = StudentGenerator(model, model.state_dict, seed=0)
    rows = generator._rollout(make_prompts(1)[0], 3)
    assert len(rows) == 3
    assert all(r["input_ids"][:PROMPT_LENGTH] == list(make_prompts(1)[0].tokens) for r in rows)
    assert all(len(r["generation_logprobs"]) == len(r["input_ids"]) - PROMPT_LENGTH for r in rows)


def _check_a_stop_stops(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping(TINY)
    summary = _run(config, tmp_path / "stopped", _random_teachers(config), stop_after=2)
    assert summary.stopped_early and summary.steps < config.steps


def _advantage_keeps_its_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    import groupflow.impl._trainer._learner as learner_module

    def loss(logprobs: Any, generation: Any, teacher: Any, **kw: Any) -> Any:
        advantage = teacher - generation + 0 * logprobs  # the stop-gradient forgotten
        weight = torch.exp(logprobs.detach() - generation).clamp(kw["clip_low"], kw["clip_high"])
        return learner_module.LossParts(
            -(weight * advantage * logprobs).mean(), advantage, weight, 0.0
        )

    monkeypatch.setattr(learner_module, "distill_loss", loss)
    monkeypatch.setattr(sys.modules[__name__], "distill_loss", loss)


def _advantage_sign_flipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import groupflow.impl._trainer._learner as learner_module

    original = learner_module.distill_loss

    def loss(logprobs: Any, generation: Any, teacher: Any, **kw: Any) -> Any:
        return original(logprobs, teacher, generation, **kw)

    monkeypatch.setattr(learner_module, "distill_loss", loss)
    monkeypatch.setattr(sys.modules[__name__], "distill_loss", loss)


def _weights_not_truncated(monkeypatch: pytest.MonkeyPatch) -> None:
    import groupflow.impl._trainer._learner as learner_module

    original = learner_module.distill_loss

    def loss(logprobs: Any, generation: Any, teacher: Any, **kw: Any) -> Any:
        return original(logprobs, generation, teacher, clip_low=0.0, clip_high=float("inf"))

    monkeypatch.setattr(learner_module, "distill_loss", loss)
    monkeypatch.setattr(sys.modules[__name__], "distill_loss", loss)


def _refit_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(self: StudentGenerator, weights: Any, version: int) -> None:
        self.version = version  # the version moves, the weights stay

    monkeypatch.setattr(StudentGenerator, "_load", load)


def _stop_request_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TrainPump, "request_stop", lambda self: None)


TRAINER_BUGS: dict[str, tuple[Any, Any]] = {
    "the advantage keeps its gradient": (_advantage_keeps_its_gradient, _check_the_loss_by_hand),
    "the advantage's sign is flipped": (_advantage_sign_flipped, _check_the_loss_by_hand),
    "the importance weights are not truncated": (_weights_not_truncated, _check_the_loss_by_hand),
    "the refit moves the version but not the weights": (_refit_copies_nothing, _check_the_refit),
    "a stop request is ignored": (_stop_request_ignored, _check_a_stop_stops),
}


@pytest.mark.parametrize("bug", sorted(TRAINER_BUGS))
def test_seeded_trainer_bugs_are_caught(
    bug: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    apply, check = TRAINER_BUGS[bug]
    apply(monkeypatch)
    with pytest.raises(AssertionError):
        check(tmp_path) if check is _check_a_stop_stops else check()


def test_the_trainer_page_shows_the_default_config() -> None:
    page = (ROOT / "docs" / "trainer.md").read_text()
    assert f"```toml\n{TrainConfig().to_toml()}```" in page
