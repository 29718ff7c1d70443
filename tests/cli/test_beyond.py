"""`groupflow train --teachers-on ray` / `--store tq` without the extras: refused in one line
naming the extra to install (Ray is hidden from the process, so this runs everywhere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="groupflow train needs torch (pip install '.[train]')")

from groupflow.impl import TorchTeacher  # noqa: E402
from groupflow.impl._trainer._student import new_student, student_config


@pytest.mark.parametrize("flag", [["--teachers-on", "ray"], ["--store", "tq"]])
def test_the_extras_missing_is_said_in_one_line(flag: list[str], tmp_path: Path) -> None:
    teachers = []
    for i, domain in enumerate(("count", "reverse")):
        path = tmp_path / f"{domain}.pt"
        TorchTeacher(
            new_student(student_config(d_model=32, n_layers=1), seed=i), device="cpu"
        ).save(path)
        teachers += ["--teacher", f"{domain}={path}"]
    argv = ["train", "--steps", "1", "--out", str(tmp_path / "run"), "--device", "cpu"]
    code = (
        "import sys\n"
        "sys.modules['ray'] = None; sys.modules['transfer_queue'] = None\n"
        "from groupflow.cli import main\n"
        f"sys.exit(main({[*argv, *teachers, *flag]!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("groupflow train:")]
    assert len(said) == 1 and "pip install 'groupflow[" in said[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
