"""Fixtures the test files share (helpers they call directly are in `helpers.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from groupflow.impl import ReplayBuffer
from groupflow.model import assert_invariants
from tests.helpers import MakeBuffer, new_buffer


@pytest.fixture
def make_buffer() -> Iterator[MakeBuffer]:
    """`new_buffer`, and at teardown `assert_invariants` on every buffer it made."""
    made: list[ReplayBuffer] = []

    def make(**kwargs: Any) -> ReplayBuffer:
        buffer = new_buffer(**kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        assert_invariants(buffer.snapshot())


@pytest.fixture
def buffer(make_buffer: MakeBuffer) -> ReplayBuffer:
    return make_buffer()
