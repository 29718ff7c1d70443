"""The pipeline state machine at CI budget: it passes, it keeps reaching the cases it exists
for, it catches every seeded bug in the catalogue, and, with the test-only escape hatch, it finds
the deadlock the config's conditions prevent and shrinks it.

`pytest --scorer torch --device auto` runs the machine over torch teachers (CUDA when torch
sees one); `groupflow fuzz --machine pipeline` runs it with a larger budget.
"""

from __future__ import annotations

import re

import attrs
import pytest

from groupflow.impl._pipeline import PipelineConfig
from groupflow.model import decisions
from groupflow.properties import aio_bugs, pipeline_machine
from groupflow.properties.pipeline_bugs import BUGS, applied
from groupflow.properties.pipeline_machine import MARKS, run_pipeline_machine

CI_EXAMPLES = 200
CI_STEPS = 60
TORCH_EXAMPLES = 25
"""The torch variant always runs, at this budget, besides whatever `--scorer` chose."""
MUTANT_EXAMPLES = 300
"""A caught bug stops the run at its first failure (no shrinking), so a larger budget costs
only a bug caught late; the examples Hypothesis generates shift with the run's history (a
derandomized run among the whole suite generates others than alone), so there is headroom."""
UNSAFE_EXAMPLES = 1000
SHRUNK_AT_MOST = CI_STEPS
"""Rules in the shrunk deadlock example, at most. The drain alone shows the deadlock, so the
shortest example has none, but Hypothesis does not always get there: a rule's choice is drawn
among the rules enabled, which moves as steps are deleted, and deletions stop lining up. So the
test also replays the shrunk configuration with no event at all (`drain_alone`)."""


def test_pipeline_machine_conforms_and_reaches_every_mark(scorer: tuple[str, str]) -> None:
    name, device = scorer
    reached = run_pipeline_machine(
        max_examples=CI_EXAMPLES, steps=CI_STEPS, derandomize=True, scorer=name, device=device
    )
    missing = [mark for mark in MARKS if not reached[mark]]
    assert not missing, f"the machine no longer reaches {missing} (reached: {dict(reached)})"
    assert pipeline_machine.stats["completed"] > CI_EXAMPLES // 4, pipeline_machine.stats


def test_under_the_asyncio_host_with_asyncio_parts_it_conforms_and_reaches_every_mark() -> None:
    """The generator, scorer and learner are asyncio parts (`aio.part`), trio a guest on an
    asyncio loop: interleavings across the two loops, crashes, checkpoints with groups pending
    and resumes, exactly once, the bounds the checker settled."""
    reached = run_pipeline_machine(
        max_examples=CI_EXAMPLES, steps=CI_STEPS, derandomize=True, host="asyncio"
    )
    missing = [mark for mark in MARKS if not reached[mark]]
    assert not missing, f"the machine no longer reaches {missing} (reached: {dict(reached)})"
    assert pipeline_machine.stats["completed"] > CI_EXAMPLES // 4, pipeline_machine.stats


def test_under_the_asyncio_host_on_uvloop_it_conforms() -> None:
    """The asyncio host's machine on uvloop's loop: the same parts and checks."""
    pytest.importorskip("uvloop", reason="uvloop is in the test extra (not on Windows)")
    run_pipeline_machine(
        max_examples=CI_EXAMPLES // 3, steps=CI_STEPS, derandomize=True, host="uvloop"
    )
    assert pipeline_machine.stats["completed"], pipeline_machine.stats


@pytest.mark.parametrize("host", ["asyncio", "uvloop"])
@pytest.mark.parametrize("bug", sorted(aio_bugs.BUGS))
def test_the_asyncio_host_machine_catches_seeded_bridge_bug(bug: str, host: str) -> None:
    if host == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is in the test extra (not on Windows)")
    with applied(bug, aio_bugs.BUGS) as seeded, pytest.raises(AssertionError) as caught:
        run_pipeline_machine(
            max_examples=MUTANT_EXAMPLES,
            steps=CI_STEPS,
            derandomize=True,
            shrink=False,
            host=host,
        )
    assert re.search(seeded.says, str(caught.value)), str(caught.value)[:2000]


def test_pipeline_machine_over_torch_teachers(scorer: tuple[str, str]) -> None:
    """Written log-probs equal a forward pass of the teacher's model on the row alone."""
    pytest.importorskip("torch", reason="the torch variant needs torch (pip install '.[torch]')")
    run_pipeline_machine(
        max_examples=TORCH_EXAMPLES,
        steps=CI_STEPS,
        derandomize=True,
        scorer="torch",
        device=scorer[1],
    )
    assert pipeline_machine.stats["completed"] > 0, pipeline_machine.stats


def test_the_catalogue_has_at_least_twelve_bugs() -> None:
    assert len(BUGS) >= 12, sorted(BUGS)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches_seeded_bug(bug: str, scorer: tuple[str, str]) -> None:
    with applied(bug) as seeded, pytest.raises(AssertionError) as caught:
        run_pipeline_machine(
            max_examples=MUTANT_EXAMPLES,
            steps=CI_STEPS,
            derandomize=True,
            shrink=False,
            scorer=scorer[0],
            device=scorer[1],
        )
    assert re.search(seeded.says, str(caught.value)), str(caught.value)[:2000]


def test_seeded_bugs_are_taken_out_again() -> None:
    """After `applied`, the machine passes again: a bug left patched in would fail the suite's
    other tests for a reason no one could see."""
    with applied("a teacher call is not bounded by call_timeout_s"):
        pass
    run_pipeline_machine(max_examples=10, steps=30, derandomize=True)


def test_without_the_safety_conditions_the_machine_finds_the_deadlock_and_shrinks_it() -> None:
    """The escape hatch (no flush timer, no demand dispatch, a batch larger than admission can
    fill): the fair drain cannot finish. The shrunk example's configuration deadlocks with no
    event at all, and is one the model's conditions refuse."""
    with pytest.raises(AssertionError, match="fair drain did not complete"):
        run_pipeline_machine(
            max_examples=UNSAFE_EXAMPLES, steps=CI_STEPS, derandomize=True, unsafe=True
        )
    assert len(pipeline_machine.last_example) <= SHRUNK_AT_MOST, pipeline_machine.last_example
    (setup,) = pipeline_machine.last_setup
    config, scoring = setup.config, setup.config.scoring
    assert scoring is not None and config.shape.max_batch_groups > 1, setup
    stuck = pipeline_machine.drain_alone(setup, unsafe=True)
    assert stuck is not None and "fair drain did not complete" in stuck
    assert decisions.config_problems(
        shape=config.shape,
        design=scoring.design,
        flush_timer=False,
        demand=False,
    )
    assert pipeline_machine.drain_alone(attrs.evolve(setup, config=_with_timer(config))) is None


def _with_timer(config: PipelineConfig) -> PipelineConfig:
    """The same configuration with the flush timer the pipeline insists on."""
    assert config.scoring is not None
    scoring = attrs.evolve(config.scoring, flush_after_s=2.0)
    return attrs.evolve(config, scoring=scoring)
