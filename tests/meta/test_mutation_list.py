"""The list of mutants judged equivalent (`bench/mutation_equivalent.toml`) stays true to the
code: an entry whose line is gone from its module would excuse a survivor it was never meant
for, or nothing at all."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.helpers import ROOT

ENTRIES = tomllib.loads((ROOT / "bench" / "mutation_equivalent.toml").read_text("utf-8"))[
    "equivalent"
]


def _glob(text: str, pattern: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text) is not None


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['module']}:{e['line'][:40]}" for e in ENTRIES])
def test_each_equivalent_mutant_names_a_line_of_its_module_and_says_why(
    entry: dict[str, str],
) -> None:
    assert set(entry) <= {"module", "operator", "line", "mutant", "why"}, entry
    assert entry["operator"].startswith("core/"), entry
    assert len(entry["why"]) > 20, entry
    source = (ROOT / entry["module"]).read_text("utf-8").splitlines()
    assert any(_glob(line.strip(), entry["line"].strip()) for line in source), (
        f"{entry['module']} has no line {entry['line']!r}: the entry is stale"
    )
