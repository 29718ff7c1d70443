"""Seeded bugs in the pipeline: small, named changes of behaviour the pipeline machine must
catch, each with the words the machine's failure says.

Each is a plausible mistake in the code the machine drives: a permit, a timer, a queue, a
checkpoint, a padded batch, a time limit. `applied(bug)` patches it in and takes it out again;
`tests/properties/test_pipeline_machine.py` asserts the machine catches every one at the CI budget, and
`bench/catch_rate.py` measures how short the shrunk examples are.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from groupflow.impl._core import PromptLedger, ReplayBuffer
from groupflow.impl._pipeline import RolloutPump, ScoringStage
from groupflow.impl._pipeline import _rollout as rollout_module
from groupflow.impl._pipeline import _scoring_stage as stage_module
from groupflow.impl._teachers import _batch as teacher_batch
from groupflow.model import GroupState, decisions


@attrs.define
class Patches:
    """Attributes set for the length of a `with applied(...)` block, then put back."""

    _undo: list[tuple[object, str, object]] = attrs.field(factory=list)

    def setattr(self, target: object, name: str, value: object) -> None:
        self._undo.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def restore(self) -> None:
        while self._undo:
            target, name, value = self._undo.pop()
            setattr(target, name, value)


@attrs.frozen
class SeededBug:
    apply: Callable[[Patches], None]
    says: str
    """A regular expression the machine's failure message matches when it catches the bug."""


def _impl_decisions(module: types.ModuleType, **overrides: Any) -> types.SimpleNamespace:
    """`groupflow.model.decisions` as one pipeline module sees it, with some functions changed:
    the model (and so the conformance checker) keeps the real ones."""
    names = {name: getattr(decisions, name) for name in dir(decisions) if not name.startswith("__")}
    return types.SimpleNamespace(**{**names, **overrides})


def _permit_freed_before_commit(patch: Patches) -> None:
    original = RolloutPump._generate_and_commit

    async def early(self: RolloutPump, ordinal: int, gid: str) -> None:
        self._release(ordinal)  # the permit goes before the rows are written
        await original(self, ordinal, gid)

    patch.setattr(RolloutPump, "_generate_and_commit", early)


def _checkpoint_forgets_reissue(patch: Patches) -> None:
    original = PromptLedger.state_dict

    def state_dict(self: PromptLedger, *, saved: set[int]) -> dict[str, Any]:
        return {**original(self, saved=saved), "reissue": []}

    patch.setattr(PromptLedger, "state_dict", state_dict)


def _resume_forgets_reissue(patch: Patches) -> None:
    original = PromptLedger.load_state_dict

    def load_state_dict(self: PromptLedger, state: Any) -> None:
        original(self, {**state, "reissue": []})

    patch.setattr(PromptLedger, "load_state_dict", load_state_dict)


def _admission_ignores_gate(patch: Patches) -> None:
    def admission(**kw: Any) -> Any:
        return decisions.admission(**{**kw, "gate_window": kw["gate_window"] + 1})

    patch.setattr(rollout_module, "decisions", _impl_decisions(rollout_module, admission=admission))


def _failed_rollout_not_given_up(patch: Patches) -> None:
    patch.setattr(PromptLedger, "mark_shortfall", lambda self, ordinal: None)


def _retry_queued_at_the_back(patch: Patches) -> None:
    original = ScoringStage._enqueue

    def enqueue(self: ScoringStage, teacher: str, item: Any, *, front: bool = False) -> None:
        original(self, teacher, item, front=False)

    patch.setattr(ScoringStage, "_enqueue", enqueue)


def _retries_whatever_the_policy(patch: Patches) -> None:
    patch.setattr(
        stage_module,
        "decisions",
        _impl_decisions(stage_module, retry_after_failure=lambda *args, **kw: True),
    )


class _NoTimer:
    """A stage's scoring config whose flush deadline is never reached."""

    flush_after_s = math.inf

    def __init__(self, config: object) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _timer_never_fires(patch: Patches) -> None:
    original = ScoringStage.__init__

    def init(self: ScoringStage, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.config = _NoTimer(self.config)  # type: ignore[assignment]

    patch.setattr(ScoringStage, "__init__", init)


def _timer_check_disagrees_with_deadline(patch: Patches) -> None:
    def reasons(**kw: Any) -> Any:
        return decisions.dispatch_reasons(**{**kw, "timer_expired": False})

    patch.setattr(
        stage_module, "decisions", _impl_decisions(stage_module, dispatch_reasons=reasons)
    )


def _call_not_awaited(patch: Patches) -> None:
    original = ScoringStage._call

    async def call(self: ScoringStage, teacher: str, batch: Any, reason: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(original, self, teacher, batch, reason)  # the worker goes on

    patch.setattr(ScoringStage, "_call", call)


def _call_timeout_ignored(patch: Patches) -> None:
    async def unbounded(scorer: Any, request: Any, *, timeout_s: float) -> None:
        await scorer.score(request)

    patch.setattr(stage_module, "call_scorer", unbounded)


def _pads_kept_after_failure(patch: Patches) -> None:
    original = teacher_batch._clear_pads

    def clear(store: Any, pads: list[str], error: BaseException | None) -> None:
        if error is None:
            original(store, pads, error)

    patch.setattr(teacher_batch, "_clear_pads", clear)


def _scores_shifted_by_pads(patch: Patches) -> None:
    def write(store: Any, real: list[str], scored: list[list[float]], field: str) -> None:
        tail = scored[len(scored) - len(real) :]  # the padding rows' values end up used
        store.add_fields({sid: {field: v} for sid, v in zip(real, tail, strict=True)})

    patch.setattr(teacher_batch, "_write_scores", write)


def _other_steps_selected(patch: Patches) -> None:
    def selectable(self: ReplayBuffer, slot: Any, step: int, weight_version: int) -> bool:
        return not self._stale(slot, step, weight_version)  # any step's READY group will do

    patch.setattr(ReplayBuffer, "_selectable", selectable)


def _verifier_skipped_on_retry(patch: Patches) -> None:
    original = ScoringStage._hand_on

    def hand_on(self: ScoringStage, ids: Any, states: Any) -> None:
        # a group that needed a retry at the teacher is taken for done: never handed on
        kept = [(g, s) for g, s in zip(ids, states, strict=True) if not self.buffer.retries_of(g)]
        original(self, [g for g, _ in kept], [s for _, s in kept])

    patch.setattr(ScoringStage, "_hand_on", hand_on)


def _verifier_demand_forgets_the_teacher(patch: Patches) -> None:
    def only_rollouts(self: ScoringStage, step: int) -> bool:
        return any(g.target_step == step for g in self.buffer.groups(GroupState.RESERVED))

    patch.setattr(ScoringStage, "_step_upstream", only_rollouts)


BUGS: dict[str, SeededBug] = {
    "rollout frees its permit before the commit writes rows": SeededBug(
        _permit_freed_before_commit, "rollouts generating on"
    ),
    "checkpoint forgets the prompts to issue again": SeededBug(
        _checkpoint_forgets_reissue, "snapshot taken: its write starts, the live state differs"
    ),
    "resume forgets the prompts to issue again": SeededBug(
        _resume_forgets_reissue, "after resume, the live state differs from the model's: reissue"
    ),
    "admission lets prompts one step past the gate": SeededBug(
        _admission_ignores_gate, "the model does not allow action .*: admit"
    ),
    "a failed rollout is not given up": SeededBug(
        _failed_rollout_not_given_up, "the live state differs from the model's: shortfall"
    ),
    "a retried group goes to the back of its queue": SeededBug(
        _retry_queued_at_the_back, "call fails .* differs from the model's: pending"
    ),
    "failed calls are retried whatever the policy": SeededBug(
        _retries_whatever_the_policy, "call fails .* differs from the model's"
    ),
    "the flush timer never fires": SeededBug(_timer_never_fires, "fair drain did not complete"),
    "the timer check disagrees with the deadline": SeededBug(
        _timer_check_disagrees_with_deadline, "busy loop"
    ),
    "a teacher's worker starts its next call before the last returned": SeededBug(
        _call_not_awaited,
        # whichever sees the second call first: conformance (at the dispatch, at the drop of a
        # group the model still has queued behind it, or the state after it), or the teacher
        "does not allow action .*: (send a batch|shutdown drops)"
        "|differs from the model's: pending|two calls at once",
    ),
    "a teacher call is not bounded by call_timeout_s": SeededBug(
        _call_timeout_ignored, "past call_timeout_s"
    ),
    "a failed call leaves its padding rows in the store": SeededBug(
        _pads_kept_after_failure, "rows in the store that no live group owns: .*groupflow-pad"
    ),
    "a padded batch writes the padding rows' log-probs to real rows": SeededBug(
        _scores_shifted_by_pads, "teacher log-probs written wrong"
    ),
    "a step trains READY groups of later steps": SeededBug(
        _other_steps_selected, "select its groups, the live state differs from the model's"
    ),
    "a group retried at the teacher never reaches the verifier": SeededBug(
        _verifier_skipped_on_retry, "its groups scored, the live state differs from the model's"
    ),
    "the verifier's demand dispatch forgets groups still at the teacher": SeededBug(
        _verifier_demand_forgets_the_teacher, "the model does not allow action .*: stage 2: send"
    ),
}
"""The catalogue, by what goes wrong."""


@contextlib.contextmanager
def applied(name: str, catalogue: Mapping[str, SeededBug] = BUGS) -> Iterator[SeededBug]:
    """Patch bug `name` of `catalogue` in for the block (a `KeyError` lists the names)."""
    try:
        bug = catalogue[name]
    except KeyError:
        raise KeyError(f"no seeded bug {name!r}; have {sorted(catalogue)}") from None
    patch = Patches()
    bug.apply(patch)
    try:
        yield bug
    finally:
        patch.restore()
