"""Fixtures the simulator's test files share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from groupflow.sim.run import PUMP_DEMAND, Variant, simulate
from groupflow.sim.scenario import parse_scenario

BIMODAL = "[" + ", ".join(["0.1"] * 10 + ["1.9"] * 10) + "]"
SERVED = f"""
name = "served"
steps = 60
[pipeline]
prompts_per_step = 8
num_generations_per_prompt = 4
max_inflight_prompts = 16
max_buffered_groups = 32
[scoring]
max_batch_groups = 8
flush_after_s = 0.05
[generation]
median_s = 0.3
sigma = 0.1
min_s = 0.05
[teachers.teacher]
fixed_s = 0.05
per_row_s = 0.01
spread = {BIMODAL}
[weight_sync]
fixed_s = 0.6
mode = "wait"
spread = {BIMODAL}
[train]
step_s = 0.02
"""


def _served(
    text: str, folder: Path, seed: int = 0, variant: Variant = PUMP_DEMAND
) -> tuple[Path, Any]:
    """Simulate the scenario `text` into `folder` (in the design of `variant`): its trace,
    with the weight syncs' seconds beside it as the trainer writes them (`metrics.jsonl`), and
    its result."""
    trace = folder / "trace.jsonl"
    result = simulate(parse_scenario(text), variant, trace=trace, seed=seed)
    syncs = [s for s in result.spans if s.kind == "sync"]
    lines = [f'{{"step": {i}, "sync_s": {s.end - s.start}}}' for i, s in enumerate(syncs)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return trace, result


@pytest.fixture(scope="session")
def served_scenario() -> str:
    """The served run's scenario, as TOML text."""
    return SERVED


@pytest.fixture(scope="session")
def served() -> Callable[..., tuple[Path, Any]]:
    """Simulate a scenario's text into a folder, as the served run is."""
    return _served


@pytest.fixture(scope="module")
def served_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A simulated served run (bimodal syncs and teacher calls, as a served engine's are):
    its trace, with the weight syncs' seconds beside it, and its result."""
    return _served(SERVED, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def outlasted_by_noise(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served run's trace on a seed where its syncs' drains outlast its fit's, by chance
    alone: no drain was simulated."""
    return _served(SERVED, tmp_path_factory.mktemp("noise"), seed=2)[0]
