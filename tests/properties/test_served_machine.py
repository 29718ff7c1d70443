"""The pipeline over served engines with faults on the wire (`groupflow.properties.
served_machine`), at the CI budget: it holds on today's code, keeps reaching the cases it is
for, and catches each of its seeded bugs (`served_bugs`). Real HTTP and a real clock: each
example runs a pipeline against two `VLLMImitation` servers."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("httpx", reason="the served engines need httpx: pip install -e '.[served]'")

from groupflow.properties import served_machine  # noqa: E402
from groupflow.properties.pipeline_bugs import applied  # noqa: E402
from groupflow.properties.served_bugs import BUGS  # noqa: E402

EXAMPLES = 30
SEED = 1
BUG_EXAMPLES = 80
"""At this seed each seeded bug is caught within 20 examples; the budget leaves room for a
loaded machine's timing (every example runs on the real clock)."""


def test_the_served_machine_holds_and_reaches_its_cases() -> None:
    marks = served_machine.run_served_machine(max_examples=EXAMPLES, seed=SEED)
    stats = served_machine.stats
    assert stats["examples"] >= EXAMPLES
    assert stats["completed"] and stats["resumed"], dict(stats)
    missed = [m for m in served_machine.MARKS if not marks[m]]
    assert not missed, dict(marks)


def _messages(exc: BaseException) -> list[str]:
    """The failure's message and those of the failures grouped in it (Hypothesis groups a
    failure that did not repeat on a second run, as real-time races may)."""
    out = [str(exc)]
    for inner in getattr(exc, "exceptions", ()):
        out += _messages(inner)
    return out


@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_seeded_bug_is_caught_by_the_served_machine(name: str) -> None:
    with applied(name, BUGS) as bug, pytest.raises(BaseException) as caught:
        served_machine.run_served_machine(max_examples=BUG_EXAMPLES, seed=SEED, shrink=False)
    messages = _messages(caught.value)
    assert any(re.search(bug.says, m) for m in messages), messages[:3]
