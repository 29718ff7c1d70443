"""Fixtures the test files share (helpers they call directly are in `helpers.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from groupflow.impl import ReplayBuffer
from groupflow.model import assert_invariants
from groupflow.properties.pipeline_machine import SCORERS
from tests.helpers import MakeBuffer, new_buffer


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("groupflow")
    group.addoption(
        "--scorer",
        choices=list(SCORERS),
        default="fake",
        help="the teachers the pipeline machine scores with (default fake; torch: TorchTeacher)",
    )
    group.addoption(
        "--device",
        default="cpu",
        help="where torch teachers run: cpu (default), auto (CUDA when torch sees one), cuda:0",
    )


VLLM_TEST_TIMEOUT_S = 1500
"""pytest-timeout's limit for a test of the `vllm` marker without a limit of its own: the first
of a file starts a real server (up to 900 s to be ready on a loaded machine) and warms it up."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))


@pytest.fixture
def scorer(request: pytest.FixtureRequest) -> tuple[str, str]:
    """`--scorer` and `--device`: which teachers the pipeline machine uses, and where."""
    name = request.config.getoption("--scorer")
    if name == "torch":
        pytest.importorskip("torch", reason="--scorer torch needs torch (pip install '.[torch]')")
    return name, request.config.getoption("--device")


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
