"""The pipeline state machine at CI budget: it passes, it keeps reaching the cases it exists
for, and it catches seeded bugs in the pipeline.

`groupflow fuzz --machine pipeline` runs the same machine with a larger budget.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import pytest

from groupflow.impl.core import PromptLedger
from groupflow.impl.pipeline import RolloutPump, TeacherStage
from groupflow.impl.pipeline import _rollout as rollout_module
from groupflow.impl.pipeline import _teacher_stage as stage_module
from groupflow.model import decisions
from groupflow.properties.pipeline_machine import MARKS, run_pipeline_machine

CI_EXAMPLES = 120
CI_STEPS = 60
MUTANT_EXAMPLES = 300
"""A caught bug stops the run at its first failure (no shrinking), so a larger budget costs
only a bug caught late; the examples Hypothesis generates shift with the run's history (a
derandomized run among the whole suite generates others than alone), so there is headroom."""


def test_pipeline_machine_conforms_and_reaches_every_mark() -> None:
    reached = run_pipeline_machine(max_examples=CI_EXAMPLES, steps=CI_STEPS, derandomize=True)
    missing = [mark for mark in MARKS if not reached[mark]]
    assert not missing, f"the machine no longer reaches {missing} (reached: {dict(reached)})"


def _impl_decisions(module: types.ModuleType, **overrides: Any) -> types.SimpleNamespace:
    """`groupflow.model.decisions` as one pipeline module sees it, with some functions changed:
    the model (and so the conformance checker) keeps the real ones."""
    names = {name: getattr(decisions, name) for name in dir(decisions) if not name.startswith("__")}
    return types.SimpleNamespace(**{**names, **overrides})


def _permit_freed_before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RolloutPump._generate_and_commit

    async def early(self: RolloutPump, ordinal: int, gid: str) -> None:
        self._release(ordinal)  # the permit goes before the rows are written
        await original(self, ordinal, gid)

    monkeypatch.setattr(RolloutPump, "_generate_and_commit", early)


def _checkpoint_forgets_reissue(monkeypatch: pytest.MonkeyPatch) -> None:
    original = PromptLedger.state_dict

    def state_dict(self: PromptLedger, *, saved: set[int]) -> dict[str, Any]:
        return {**original(self, saved=saved), "reissue": []}

    monkeypatch.setattr(PromptLedger, "state_dict", state_dict)


def _admission_ignores_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    def admission(**kw: Any) -> Any:
        return decisions.admission(**{**kw, "gate_window": kw["gate_window"] + 1})

    monkeypatch.setattr(
        rollout_module, "decisions", _impl_decisions(rollout_module, admission=admission)
    )


def _retry_queued_at_the_back(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TeacherStage._enqueue

    def enqueue(self: TeacherStage, teacher: str, item: Any, *, front: bool = False) -> None:
        original(self, teacher, item, front=False)

    monkeypatch.setattr(TeacherStage, "_enqueue", enqueue)


class _NoTimer:
    """A stage's scoring config whose flush deadline is never reached."""

    flush_after_s = math.inf

    def __init__(self, config: object) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _timer_never_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TeacherStage.__init__

    def init(self: TeacherStage, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.config = _NoTimer(self.config)  # type: ignore[assignment]

    monkeypatch.setattr(TeacherStage, "__init__", init)


def _timer_check_disagrees_with_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    def reasons(**kw: Any) -> Any:
        return decisions.dispatch_reasons(**{**kw, "timer_expired": False})

    monkeypatch.setattr(
        stage_module, "decisions", _impl_decisions(stage_module, dispatch_reasons=reasons)
    )


def _retries_whatever_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        stage_module,
        "decisions",
        _impl_decisions(stage_module, retry_after_failure=lambda *args, **kw: True),
    )


MUTANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    # each with what the machine says when it catches it
    "rollout frees its permit before the commit writes rows": (
        _permit_freed_before_commit,
        "rollouts generating on",
    ),
    "checkpoint forgets the prompts to issue again": (
        _checkpoint_forgets_reissue,
        "checkpoint saved, the live state differs",
    ),
    "admission lets prompts one step past the gate": (
        _admission_ignores_gate,
        "the model does not allow action .*: admit",
    ),
    "a retried group goes to the back of its queue": (
        _retry_queued_at_the_back,
        "call fails .* differs from the model's: pending",
    ),
    "failed calls are retried whatever the policy": (
        _retries_whatever_the_policy,
        "call fails .* differs from the model's",
    ),
    "the flush timer never fires": (_timer_never_fires, "fair drain did not complete"),
    "the timer check disagrees with the deadline": (
        _timer_check_disagrees_with_deadline,
        "busy loop",
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_machine_catches_seeded_bug(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    apply, says = MUTANTS[mutant]
    apply(monkeypatch)
    with pytest.raises(AssertionError, match=says):
        run_pipeline_machine(
            max_examples=MUTANT_EXAMPLES, steps=CI_STEPS, derandomize=True, shrink=False
        )
