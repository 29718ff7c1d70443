"""The examples run, and the docs quote them exactly, so neither goes stale: a change to the
contract (or to the asyncio host) that breaks an example fails here."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "custom_client.py"
ASYNCIO_EXAMPLE = ROOT / "examples" / "asyncio_controller.py"
QUOTED = [(EXAMPLE, "contract.md"), (ASYNCIO_EXAMPLE, "asyncio.md")]


def _regions(source: str) -> dict[str, str]:
    pattern = r"# --8<-- \[start:(\w+)\]\n(.*?)# --8<-- \[end:\1\]"
    found = re.findall(pattern, source, flags=re.DOTALL)
    return {name: textwrap.dedent(body).strip() for name, body in found}


def _quoted(page: str) -> list[tuple[str, str]]:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    pattern = r"<!-- example: (\w+) -->\n```python\n(.*?)```"
    return [(name, body.strip()) for name, body in re.findall(pattern, text, flags=re.DOTALL)]


@pytest.mark.parametrize(("example", "page"), QUOTED, ids=[p for _, p in QUOTED])
def test_the_docs_quote_every_region_of_the_example_as_it_is(example: Path, page: str) -> None:
    regions = _regions(example.read_text(encoding="utf-8"))
    quoted = _quoted(page)
    assert [name for name, _ in quoted] == list(regions), "quote every region, in order"
    for name, body in quoted:
        assert body == regions[name], f"docs/{page}'s quote of {name!r} differs from the example"


def _run(example: Path, folder: Path) -> str:
    """The example run to its end in a process of its own: it exits 0 and says nothing on
    stderr; returns its stdout."""
    done = subprocess.run(
        [sys.executable, str(example), str(folder)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stderr.strip(), done.stderr[-3000:]
    return done.stdout


def test_the_example_client_runs_and_trains_every_prompt_once(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the example client needs torch")
    assert "every prompt trained once: " in _run(EXAMPLE, tmp_path)
    assert (tmp_path / "latest").is_file()


@pytest.mark.ray
def test_the_asyncio_controller_crashes_resumes_and_trains_every_prompt_once(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ray", reason="the asyncio controller needs the ray extra")
    said = _run(ASYNCIO_EXAMPLE, tmp_path)
    assert "run 2: resumed from the newest checkpoint" in said
    assert "every one of 48 prompts trained exactly once" in said
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) >= 2
