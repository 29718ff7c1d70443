"""The teacher probe: calls of each size timed on trio's clock, what came back checked, and the
file the fit reads written and read back checked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from groupflow.impl._teachers import (
    PROBE_REPEATS,
    ProbeCall,
    _probe,
    probe_teachers,
    read_probe,
    write_probe,
)
from groupflow.impl.contract import ScoreRequest, TokenRow
from groupflow.impl.errors import ScoringTimeout, TeacherOutputError
from groupflow.impl.testing import FakeScorer
from groupflow.model.errors import TraceCorrupt

ROWS = [TokenRow((1, 2, 3, 4), 3) for _ in range(16)]
"""Rows of one response token: `FakeScorer` writes one value a row."""


async def _probe_fake(scorer: Any, sizes: tuple[int, ...] = (1, 2, 4)) -> list[ProbeCall]:
    return await probe_teachers(
        scorer, ["a", "b"], ROWS, rows_per_group=4, sizes=sizes, call_limit_s=60.0
    )


async def test_each_size_is_timed_repeats_times_after_a_warm_up(autojump_clock: Any) -> None:
    scorer = FakeScorer(fixed=0.05, per_row=0.01)
    calls = await _probe_fake(scorer)
    for teacher in ("a", "b"):
        mine = [c for c in calls if c.teacher == teacher]
        assert [c.rows for c in mine] == [4, 8, 16] * PROBE_REPEATS
        assert [c.seconds for c in mine] == pytest.approx([0.05 + 0.01 * c.rows for c in mine])
        assert all(c.tokens == 4 * c.rows for c in mine)
    # the warm-up call (the largest) ran first and is not among them
    assert len(scorer.calls) == 2 * (1 + 3 * PROBE_REPEATS)
    assert scorer.calls[0].rows == 16


async def test_a_call_past_its_limit_is_a_timeout_naming_the_teacher(autojump_clock: Any) -> None:
    scorer = FakeScorer(fixed=1_000.0)
    with pytest.raises(ScoringTimeout, match="teacher 'a' did not return within call_timeout_s=60"):
        await _probe_fake(scorer)


class _Wrong:
    """Writes `values` values for every row, or nothing where `values` is None."""

    def __init__(self, values: int | None) -> None:
        self.values = values

    async def score(self, request: ScoreRequest) -> None:
        await trio.sleep(0.1)
        if self.values is not None:
            request.store.add_fields(
                {sid: {request.field: [-1.0] * self.values} for sid in request.sample_ids}
            )


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (None, "wrote nothing for 16 of them"),
        (
            3,
            r"a probe call: teacher returned the wrong length for rows .r0. \(3 values, 1 tokens\)",
        ),
    ],
)
async def test_what_came_back_is_checked(
    autojump_clock: Any, values: int | None, says: str
) -> None:
    with pytest.raises(TeacherOutputError, match=says):
        await _probe_fake(_Wrong(values))


async def test_seeded_bug_the_probe_trusting_what_came_back_is_caught(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_probe, "_check_written", lambda request, rows: None)
    with pytest.raises(pytest.fail.Exception):
        await test_what_came_back_is_checked(autojump_clock, 3, "3 values, 1 tokens")


@pytest.mark.parametrize("sizes", [(), (0, 1), (1, 5)])
async def test_sizes_beyond_the_rows_are_refused(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="probe sizes"):
        await _probe_fake(FakeScorer(), sizes)


def test_the_file_reads_back_as_written(tmp_path: Path) -> None:
    calls = [ProbeCall("a", 4, 40, 0.25), ProbeCall("b", 32, 320, 1.5)]
    write_probe(tmp_path / "p.json", calls)
    assert read_probe(tmp_path / "p.json") == tuple(calls)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no part file left


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not a teacher probe"),
        (json.dumps({"format": 9, "calls": []}), "not a teacher probe of format 1"),
        (json.dumps({"format": 1, "calls": {}}), "its 'calls' is not a list"),
        (json.dumps({"format": 1, "calls": [{"rows": 4}]}), "call 0 is not a probe call"),
        (
            json.dumps({"format": 1, "calls": [dict(teacher="a", rows=0, tokens=1, seconds=0.1)]}),
            "call 0: rows must be an int >= 1, got 0",
        ),
        (
            json.dumps({"format": 1, "calls": [dict(teacher="a", rows=4, tokens=1, seconds=-1)]}),
            "call 0: seconds must be finite seconds >= 0, got -1",
        ),
    ],
)
def test_a_file_that_is_not_a_probe_is_refused_naming_it(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(TraceCorrupt, match=re.escape(f"{path}: {says}")):
        read_probe(path)
