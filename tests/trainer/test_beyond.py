"""`groupflow train --teachers-on ray --store tq`: the trainer's run with its teachers as Ray
worker groups and its rows in TransferQueue, on a local Ray; the run trains, and its trace
replays valid. Skipped without the `ray` and `tq` extras (and torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="groupflow train needs torch (pip install '.[train]')")
pytest.importorskip("ray", reason="needs the ray and tq extras: pip install -e '.[ray,tq]'")
pytest.importorskip("transfer_queue", reason="needs the tq extra: pip install -e '.[ray,tq]'")

from groupflow.impl import TorchTeacher  # noqa: E402
from groupflow.impl._trainer._student import new_student, student_config
from groupflow.sim.verify.replay import replay  # noqa: E402
from tests.helpers import tiny_train_toml  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.tq]


@pytest.mark.timeout(600)  # the subprocess's own limit comes first
def test_train_with_ray_teachers_and_a_tq_store(tmp_path: Path) -> None:
    args = []
    for i, domain in enumerate(("count", "reverse")):
        path = tmp_path / f"{domain}.pt"
        TorchTeacher(
            new_student(student_config(d_model=32, n_layers=1), seed=i), device="cpu"
        ).save(path)
        args += ["--teacher", f"{domain}={path}"]
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_train_toml(steps=4))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "train", "--config", str(config),
         "--out", str(out), "--no-progress", "--device", "cpu", *args,
         "--teachers-on", "ray", "--store", "tq", "--teacher-dp", "2"],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "teachers: ray (2 worker groups of 2 actors); store: tq" in done.stderr
    assert "steps: 4" in done.stdout
    verdict = replay(out)
    assert verdict.verdict == "valid", verdict.problem
    assert len(verdict.trained) == 4 * 2
