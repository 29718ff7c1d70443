"""The torch teacher: log-probs by definition, independent of batching, through the stage."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install 'groupflow[torch]'")

import trio  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row, ScoringConfig  # noqa: E402
from groupflow.impl._pipeline import ScoringStage, ThreadedScorer  # noqa: E402
from groupflow.impl._teachers import BatchMeta, TeacherScorer, score_teacher_batch  # noqa: E402
from groupflow.impl._teachers._torch import (  # noqa: E402
    PRESETS,
    TorchTeacher,
    batch_tolerance,
    reference_logprobs,
)
from groupflow.impl.contract import (  # noqa: E402
    TEACHER_FIELD,
    TokenRow,  # noqa: E402
)
from groupflow.model import GroupState  # noqa: E402

TEACHER = TorchTeacher.from_config(PRESETS["tiny"], seed=0, device="cpu")


def rows_strategy() -> st.SearchStrategy[list[list[TokenRow]]]:
    def row(length: int) -> st.SearchStrategy[TokenRow]:
        return st.builds(
            TokenRow,
            st.lists(st.integers(0, 255), min_size=length, max_size=length).map(tuple),
            st.integers(1, length - 1),
        )

    group = st.integers(2, 40).flatmap(lambda n: st.lists(row(n), min_size=1, max_size=4))
    return st.lists(group, min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(groups=rows_strategy(), dp=st.integers(1, 4))
def test_one_call_for_all_groups_equals_one_call_per_group(
    groups: list[list[TokenRow]], dp: int
) -> None:
    teacher = TorchTeacher(TEACHER.model, dp_size=dp, device="cpu")

    def score(rows: list[TokenRow]) -> list[list[float]]:
        store = MemoryStore()
        store.put(
            {
                f"r{i}": {"input_ids": list(r.input_ids), "prompt_length": r.prompt_length}
                for i, r in enumerate(rows)
            }
        )
        score_teacher_batch(store, teacher, BatchMeta(tuple(f"r{i}" for i in range(len(rows)))))
        assert len(store) == len(rows), "pad rows left in the store"
        got = store.get([f"r{i}" for i in range(len(rows))], [TEACHER_FIELD])
        return [got[f"r{i}"][TEACHER_FIELD] for i in range(len(rows))]

    together = score([r for g in groups for r in g])
    alone = [v for g in groups for v in score(g)]
    tolerance = batch_tolerance(torch.float32)
    for a, b in zip(together, alone, strict=True):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tolerance


def test_logprobs_match_the_definition() -> None:
    rows = [TokenRow(tuple(range(i, i + 30)), 7) for i in range(3)] + [TokenRow((5, 9, 200, 3), 1)]
    (scored,) = TEACHER.score_shards([rows])
    for row, values in zip(rows, scored, strict=True):
        expected = reference_logprobs(TEACHER.model, row)
        assert len(values) == row.response_length
        assert max(abs(a - b) for a, b in zip(values, expected, strict=True)) <= 1e-5
        assert all(v <= 0 for v in values)


def test_save_and_load_give_the_same_teacher(tmp_path: Path) -> None:
    path = tmp_path / "teacher.pt"
    TEACHER.save(path)
    loaded = TorchTeacher.load(path, device="cpu")
    row = TokenRow(tuple(range(40)), 10)
    assert loaded.score_shards([[row]]) == TEACHER.score_shards([[row]])
    assert loaded.num_parameters == TEACHER.num_parameters


def test_auto_device_is_cpu_without_cuda() -> None:
    if torch.cuda.is_available():  # pragma: no cover - only on GPU machines
        assert TorchTeacher(TEACHER.model, device="auto").device.type == "cuda"
    else:
        assert TorchTeacher(TEACHER.model, device="auto").device.type == "cpu"
        with pytest.raises(RuntimeError, match="no CUDA"):
            TorchTeacher(TEACHER.model, device="cuda")


async def test_the_stage_scores_with_the_torch_teacher() -> None:
    buffer = ReplayBuffer(
        BufferConfig(group_size=4, capacity=8, required_fields={"input_ids", TEACHER_FIELD}),
        MemoryStore(),
    )
    ids = []
    for g in range(3):
        gid = buffer.reserve(target_step=0)
        rows = [
            Row(f"{gid}/{i}", {"input_ids": list(range(g, g + 16 + i)), "prompt_length": 4})
            for i in range(4)
        ]
        await buffer.commit(
            gid, rows, start_weight_version=0, end_weight_version=0, defer_ready=True
        )
        ids.append(gid)
    teacher = TorchTeacher(TEACHER.model, dp_size=4, device="cpu")
    scorer = ThreadedScorer(TeacherScorer({"teacher": teacher}))
    stage = ScoringStage(buffer, scorer, ScoringConfig(flush_after_s=1.0), max_batch_groups=3)
    with trio.fail_after(60):
        for gid in ids:
            stage.submit(gid)
        stage.upstream_ended()
        await stage.run()
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)
    assert len(buffer.store.list_ids()) == 12
    row = buffer.store.get([f"{ids[1]}/2"], ["input_ids", TEACHER_FIELD])[f"{ids[1]}/2"]
    assert len(row[TEACHER_FIELD]) == len(row["input_ids"]) - 4


def test_bench_teacher_reports_both_timings(capsys: pytest.CaptureFixture[str]) -> None:
    from groupflow.cli import main

    args = ["bench-teacher", "--groups", "2", "--rows-per-group", "2", "--seq-len", "32"]
    assert main([*args, "--repeats", "1", "--json", "--device", "cpu"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["batched_s"] > 0 and report["separate_s"] > 0
    assert report["ratio_separate_over_batched"] == pytest.approx(
        report["separate_s"] / report["batched_s"]
    )
    assert main([*args, "--repeats", "1", "--seq-len", "5000"]) == 2


def test_hf_teacher_loads_a_saved_checkpoint_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers not installed: pip install 'groupflow[hf]'"
    )
    from groupflow.impl._teachers._hf import HFTeacher

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    teacher = HFTeacher.from_pretrained(tmp_path, dp_size=2, device="cpu")
    rows = [
        TokenRow(tuple(range(3, 40)), 5),
        TokenRow((7, 8, 9, 10), 2),
        TokenRow(tuple(range(60, 90)), 10),
    ]
    (together,) = teacher.score_shards([rows])
    for row, values in zip(rows, together, strict=True):
        (alone,) = teacher.score_shards([[row]])[0]
        assert len(values) == row.response_length
        assert max(abs(a - b) for a, b in zip(values, alone, strict=True)) <= batch_tolerance(
            torch.float32
        )
    store = MemoryStore()
    store.put(
        {
            f"r{i}": {"input_ids": list(r.input_ids), "prompt_length": r.prompt_length}
            for i, r in enumerate(rows)
        }
    )
    score_teacher_batch(store, teacher, BatchMeta(("r0", "r1", "r2")))
    assert store.list_ids() == {"r0", "r1", "r2"}


def test_torch_teacher_is_a_scorer_like_the_fake_one() -> None:
    """One protocol for the pump: the torch teacher, the HF teacher and the simulator's fake
    scorer are all `Scorer`s; the torch ones are also `Teacher`s for `score_teacher_batch`."""
    from groupflow.impl.contract import Scorer, Teacher
    from groupflow.impl.testing import FakeScorer

    assert isinstance(TEACHER, Scorer) and isinstance(TEACHER, Teacher)
    assert isinstance(FakeScorer(), Scorer)


async def test_the_stage_takes_the_torch_teacher_directly() -> None:
    buffer = ReplayBuffer(
        BufferConfig(group_size=2, capacity=4, required_fields={"input_ids", TEACHER_FIELD}),
        MemoryStore(),
    )
    gid = buffer.reserve(target_step=0)
    rows = [
        Row(f"{gid}/{i}", {"input_ids": list(range(10 + i)), "prompt_length": 3}) for i in range(2)
    ]
    await buffer.commit(gid, rows, start_weight_version=0, end_weight_version=0, defer_ready=True)
    stage = ScoringStage(buffer, TEACHER, ScoringConfig(flush_after_s=1.0), max_batch_groups=1)
    stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(30):
        await stage.run()
    assert buffer.state_of(gid) is GroupState.READY
