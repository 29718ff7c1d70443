"""Breadth-first exploration of every reachable state of the abstract scheduler.

Safety: every state is checked with `check_state`, and a non-final state where nothing but the
world's own events (a crash, a user interrupt) can happen is a deadlock. Liveness: from every
reachable state the run must be able to finish on its own, so after the search a backward pass
over the internal transitions finds the states that cannot reach a final one. Because the search
is breadth-first, the first trace found to each violation is a shortest one.

Pure: no I/O. Progress is reported through a callback the caller owns.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from groupflow.model.lifecycle import IllegalTransition
from groupflow.model.scheduler.actions import EXTERNAL_KINDS, NOT_PROGRESS_KINDS, Action
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.canonical import canonical
from groupflow.model.scheduler.checks import check_state
from groupflow.model.scheduler.guards import enabled
from groupflow.model.scheduler.reduction import ample, independent_in
from groupflow.model.scheduler.state import NotEnabled, Phase, SchedState, initial_state
from groupflow.model.scheduler.transitions import apply, transition
from groupflow.model.scheduler.words import describe, summarize

Progress = Callable[[int, int, int, float], None]
"""Called now and then with (states, transitions, frontier size, seconds so far)."""


@attrs.frozen
class Finding:
    """One violated property, with a shortest trace from the initial state to a witness."""

    kind: str
    """The invariant's name, or "deadlock" or "stuck"."""
    message: str
    trace: tuple[Action, ...]
    refused: Action | None = None
    """For an illegal transition: the action, enabled after the trace, that broke the table."""

    def replay(self, bounds: Bounds) -> list[SchedState]:
        """The states along the trace, recomputed through the model (`apply` checks each step)."""
        states = [initial_state(bounds)]
        for action in self.trace:
            states.append(apply(states[-1], bounds, action))
        return states

    def confirm(self, bounds: Bounds) -> str | None:
        """None when the trace is a real run of the model (each step enabled, replayed
        through `apply`) whose last state shows the violation; else what is wrong with it."""
        try:
            last = self.replay(bounds)[-1]
        except NotEnabled as exc:
            return f"the trace does not replay: {exc}"
        if self.kind == "illegal_transition":
            if self.refused is None:
                return "an illegal transition without the refused action"
            try:
                transition(last, bounds, self.refused)
            except IllegalTransition:
                return None
            return f"{describe(self.refused, bounds)} is not refused after the trace"
        if self.kind == "deadlock":
            return None if is_deadlocked(last, bounds) else "the last state is not deadlocked"
        if self.kind == "stuck":
            return None if not is_deadlocked(last, bounds) else "the last state is a deadlock"
        if self.kind == "reduction":
            return None
        if self.kind in {v.invariant for v in check_state(last, bounds)}:
            return None
        return f"the last state does not break {self.kind}"

    def to_json(self, bounds: Bounds) -> dict[str, object]:
        states = self.replay(bounds)
        return {
            "kind": self.kind,
            "message": self.message,
            "trace": [
                {**a.to_json(), "says": describe(a, bounds), "state": summarize(s, bounds)}
                for a, s in zip(self.trace, states[1:], strict=True)
            ],
            "refused": None if self.refused is None else self.refused.to_json(),
        }

    def explain(self, bounds: Bounds) -> str:
        """The trace step by step, in words."""
        states = self.replay(bounds)
        lines = [
            f"{self.kind}: {self.message}",
            "   (pN:STATE is prompt N's group; * it holds a generation permit; r it was retried)",
            f"   0. start: {summarize(states[0], bounds)}",
        ]
        for i, (action, state) in enumerate(zip(self.trace, states[1:], strict=True), 1):
            lines.append(f"  {i:>2}. {describe(action, bounds)}")
            lines.append(f"      -> {summarize(state, bounds)}")
        if self.refused is not None:
            lines.append(f"  {len(self.trace) + 1:>2}. {describe(self.refused, bounds)}: refused")
        return "\n".join(lines)


@attrs.frozen
class Report:
    bounds: Bounds
    states: int
    transitions: int
    final_states: int
    seconds: float
    findings: tuple[Finding, ...]
    complete: bool
    """False when the search stopped at `max_states` before visiting everything."""
    reduced: int = 0
    """States expanded through a persistent subset of their actions (0: no reduction)."""

    @property
    def ok(self) -> bool:
        return self.complete and not self.findings

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")


def _internal(action: Action) -> bool:
    return action.kind not in EXTERNAL_KINDS


def explore(
    bounds: Bounds,
    *,
    max_states: int | None = None,
    progress: Progress | None = None,
    progress_every: int = 20_000,
    reduce: bool = True,
    check_reduction: bool = False,
) -> Report:
    """Visit every state reachable from the initial one and check every property on each.

    With `reduce` (the default), the search stores one state per class of states with the
    same future (`groupflow.model.scheduler.canonical`), and a state whose actions include a persistent
    subset (`groupflow.model.scheduler.reduction`) is expanded through that subset only: fewer states,
    the same verdicts. `check_reduction` also tests, in every reduced state, that the chosen
    actions commute with each of the others (slow; for tests)."""
    encode = canonical if reduce else _same
    start = time.perf_counter()
    root = encode(initial_state(bounds), bounds)
    index: dict[SchedState, int] = {root: 0}
    parent: list[int] = [-1]
    via: list[Action | None] = [None]
    preds: list[list[int]] = [[]]  # internal predecessors, for the liveness pass
    final: list[int] = []
    first: dict[str, tuple[int, str, Action | None]] = {}  # kind -> (state id, message, refused)
    frontier: deque[SchedState] = deque([root])
    transitions = 0
    reduced = 0
    complete = True

    def note(kind: str, sid: int, message: str, refused: Action | None = None) -> None:
        if kind not in first:
            first[kind] = (sid, message, refused)

    while frontier:
        state = frontier.popleft()
        sid = index[state]
        for violation in check_state(state, bounds):
            note(violation.invariant, sid, violation.message)
        if state.phase is Phase.DONE:
            final.append(sid)
            continue
        moves = []
        refused = False
        actions = enabled(state, bounds)
        chosen = ample(state, bounds, actions) if reduce else None
        if chosen is not None:
            reduced += 1
            if check_reduction:
                others = [a for a in actions if a not in chosen]
                for problem in independent_in(state, bounds, chosen, others):
                    note("reduction", sid, problem)
            if any(a.kind not in NOT_PROGRESS_KINDS for a in chosen):
                actions = chosen
        for action in actions:
            try:
                moves.append((action, transition(state, bounds, action)))
            except IllegalTransition as exc:
                note("illegal_transition", sid, str(exc), action)
                refused = True
        if not refused and all(a.kind in NOT_PROGRESS_KINDS for a, _ in moves):
            note(
                "deadlock",
                sid,
                "no group can move: only a crash, an interrupt or a checkpoint can happen",
            )
        for action, nxt in moves:
            transitions += 1
            nxt = encode(nxt, bounds)
            nid = index.setdefault(nxt, len(parent))
            if nid == len(parent):
                if max_states is not None and nid >= max_states:
                    del index[nxt]
                    complete = False
                    continue
                parent.append(sid)
                via.append(action)
                preds.append([])
                frontier.append(nxt)
            if _internal(action):
                preds[nid].append(sid)
        if progress is not None and sid % progress_every == 0 and sid:
            progress(len(index), transitions, len(frontier), time.perf_counter() - start)

    if complete:
        stuck = _cannot_finish(len(parent), final, preds)
        if stuck is not None and "deadlock" not in first:
            note("stuck", stuck, "from here the run can never finish on its own (a livelock)")

    def trace_to(sid: int) -> tuple[Action, ...]:
        actions: list[Action] = []
        while parent[sid] >= 0:
            action = via[sid]
            assert action is not None
            actions.append(action)
            sid = parent[sid]
        return tuple(reversed(actions))

    findings = tuple(
        Finding(kind, message, trace_to(sid), refused)
        for kind, (sid, message, refused) in sorted(first.items(), key=lambda kv: kv[1][0])
    )
    return Report(
        bounds=bounds,
        states=len(parent),
        transitions=transitions,
        final_states=len(final),
        seconds=time.perf_counter() - start,
        findings=findings,
        complete=complete,
        reduced=reduced,
    )


def _same(state: SchedState, bounds: Bounds) -> SchedState:
    return state


def _cannot_finish(count: int, final: Sequence[int], preds: Sequence[list[int]]) -> int | None:
    """The lowest-numbered (so nearest the start) state with no internal path to a final one."""
    can = bytearray(count)
    queue = deque(final)
    for sid in final:
        can[sid] = 1
    while queue:
        sid = queue.popleft()
        for p in preds[sid]:
            if not can[p]:
                can[p] = 1
                queue.append(p)
    for sid in range(count):
        if not can[sid]:
            return sid
    return None


def is_deadlocked(state: SchedState, bounds: Bounds) -> bool:
    """A non-final state where no group can move."""
    return state.phase is not Phase.DONE and all(
        a.kind in NOT_PROGRESS_KINDS for a in enabled(state, bounds)
    )


@attrs.frozen
class WalkReport:
    """What `random_walks` saw: beyond exhaustive reach, a sample of runs, not a proof."""

    bounds: Bounds
    walks: int
    transitions: int
    finished: int
    """Walks that reached a final state within the depth."""
    seconds: float
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def transitions_per_second(self) -> float:
        return self.transitions / self.seconds if self.seconds > 0 else float("inf")


def random_walks(
    bounds: Bounds,
    *,
    walks: int,
    depth: int = 10_000,
    seed: int = 0,
    external_rate: float = 0.02,
    progress: Progress | None = None,
) -> WalkReport:
    """`walks` seeded random runs of the model, each up to `depth` actions, checking every
    invariant and deadlock freedom on every state on the way. For bounds the exhaustive
    search cannot finish (many prompts, teachers, faults): it finds violations, it cannot
    prove their absence, and it does not check liveness beyond "this walk finished". The
    world's events (crash, interrupt, abort, a failed step) are picked at `external_rate` per
    step, so that walks also reach the end of a run."""
    if walks < 1 or depth < 1:
        raise ValueError(f"walks and depth must be >= 1, got walks={walks}, depth={depth}")
    start = time.perf_counter()
    rng = random.Random(seed)
    first: dict[str, Finding] = {}
    transitions = finished = 0
    for walk in range(walks):
        state = initial_state(bounds)
        trace: list[Action] = []
        for _ in range(depth):
            for violation in check_state(state, bounds):
                first.setdefault(
                    violation.invariant,
                    Finding(violation.invariant, violation.message, tuple(trace)),
                )
            if state.phase is Phase.DONE:
                finished += 1
                break
            actions = enabled(state, bounds)
            if all(a.kind in NOT_PROGRESS_KINDS for a in actions):
                first.setdefault(
                    "deadlock",
                    Finding(
                        "deadlock",
                        "no group can move: only a crash, an interrupt or a checkpoint can happen",
                        tuple(trace),
                    ),
                )
                break
            internal = [a for a in actions if _internal(a)]
            if internal and rng.random() >= external_rate:
                action = rng.choice(internal)
            else:
                action = rng.choice(actions)
            try:
                state = transition(state, bounds, action)
            except IllegalTransition as exc:
                first.setdefault(
                    "illegal_transition",
                    Finding("illegal_transition", str(exc), tuple(trace), action),
                )
                break
            trace.append(action)
            transitions += 1
        if progress is not None and walk % 100 == 0 and walk:
            progress(walk, transitions, walks - walk, time.perf_counter() - start)
    shortest = sorted(first.values(), key=lambda f: len(f.trace))
    return WalkReport(
        bounds=bounds,
        walks=walks,
        transitions=transitions,
        finished=finished,
        seconds=time.perf_counter() - start,
        findings=tuple(shortest),
    )


@attrs.frozen
class Comparison:
    """The full search and the reduced one on the same bounds, and how they differ."""

    full: Report
    reduced: Report
    """Run with `check_reduction`, so its seconds are not its speed."""
    problems: tuple[str, ...]
    """Empty when they agree."""


def compare_reduction(bounds: Bounds) -> Comparison:
    """How the reduced search (the default) differs from the full one on `bounds`: a verdict
    one finds and the other does not, a trace of the reduced search that is not a real run
    ending in its violation, or a reduced state whose chosen actions do not commute with the
    others. No problem over a sweep is the evidence that the reduction is sound."""
    full = explore(bounds, reduce=False)
    reduced = explore(bounds, check_reduction=True)
    out = []
    kinds = {f.kind for f in full.findings}
    found = {f.kind for f in reduced.findings if f.kind != "reduction"}
    if kinds != found:
        out.append(f"full search finds {sorted(kinds)}, reduced finds {sorted(found)}")
    for finding in reduced.findings:
        if finding.kind == "reduction":
            out.append(f"{finding.message} (after {len(finding.trace)} steps)")
        elif (problem := finding.confirm(bounds)) is not None:
            out.append(f"{finding.kind}: {problem}")
    if reduced.states > full.states:
        out.append(f"reduced search visits more ({reduced.states}) than the full ({full.states})")
    return Comparison(full, reduced, tuple(out))
