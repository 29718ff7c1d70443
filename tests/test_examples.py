"""The example client runs, and the README's walkthrough quotes it exactly, so neither goes
stale: a change to the contract that breaks the example fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "custom_client.py"


def _regions(source: str) -> dict[str, str]:
    pattern = r"# --8<-- \[start:(\w+)\]\n(.*?)# --8<-- \[end:\1\]"
    return {name: body.strip() for name, body in re.findall(pattern, source, flags=re.DOTALL)}


def _quoted() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "contract.md").read_text(encoding="utf-8")
    pattern = r"<!-- example: (\w+) -->\n```python\n(.*?)```"
    return [(name, body.strip()) for name, body in re.findall(pattern, text, flags=re.DOTALL)]


def test_the_readme_quotes_every_region_of_the_example_as_it_is() -> None:
    regions = _regions(EXAMPLE.read_text(encoding="utf-8"))
    quoted = _quoted()
    assert [name for name, _ in quoted] == list(regions), "quote every region, in order"
    for name, body in quoted:
        assert body == regions[name], (
            f"docs/contract.md's quote of {name!r} differs from the example"
        )


def test_the_example_client_runs_and_trains_every_prompt_once(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the example client needs torch")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every prompt trained once: " in done.stdout
    assert not done.stderr.strip(), done.stderr[-3000:]
    assert (tmp_path / "latest").is_file()
