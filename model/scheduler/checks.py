"""What must hold in every state of the abstract scheduler, as one function over a state.

The buffer-level invariants are the same functions the implementation's tests use
(`groupflow.model.invariants`), applied to a snapshot built from the abstract state; the rest
are about permits, batches and the ledger of prompt ordinals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from groupflow.model.invariants import BufferSnapshot, GroupView, Violation, check_invariants
from groupflow.model.policy import Design, DispatchReason, Sampler
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.guards import dispatch_reasons
from groupflow.model.scheduler.state import Group, Phase, SchedState, _ordinals
from groupflow.model.scheduler.transitions import _ledger
from groupflow.model.states import GroupState

_S = GroupState
_WRITTEN, _SCORING = _S.WRITTEN, _S.SCORING  # bound once: faster than an enum member on 3.11
_DONE = Phase.DONE
_OWNS_ROWS = (_S.WRITTEN, _S.SCORING, _S.READY, _S.CONSUMED)


@functools.lru_cache(maxsize=4096)
def _row_ids(ordinal: int, generations: int) -> tuple[str, ...]:
    return tuple(f"p{ordinal}/{i}" for i in range(generations))


def buffer_snapshot(groups: tuple[Group, ...], rows: int, b: Bounds) -> BufferSnapshot:
    """Groups and rows of an abstract state as the buffer would show them: one row id per
    generation of a group."""
    generations = b.shape.num_generations_per_prompt
    views = tuple([_view(g.ordinal, g.state, b.target(g.ordinal), generations) for g in groups])
    counts: dict[GroupState, int] = {}
    for g in groups:
        counts[g.state] = counts.get(g.state, 0) + 1
    return BufferSnapshot(
        views,
        _store(rows, generations),
        counts,
        b.shape.max_buffered_groups,
        generations,
        frozenset(),
    )


@functools.lru_cache(maxsize=1 << 12)
def _view(ordinal: int, state: GroupState, target: int, generations: int) -> GroupView:
    """One group as the buffer shows it: the same few in most snapshots, built once."""
    return GroupView(
        group_id=f"p{ordinal}",
        state=state,
        target_step=target,
        sample_ids=_row_ids(ordinal, generations) if state in _OWNS_ROWS else (),
        ordinal=ordinal,
    )


@functools.lru_cache(maxsize=1 << 12)
def _store(rows: int, generations: int) -> frozenset[str]:
    """The row ids in the store, for the bit set `rows` of ordinals whose rows it holds."""
    return frozenset(rid for o in _ordinals(rows) for rid in _row_ids(o, generations))


@functools.lru_cache(maxsize=1 << 16)
def _buffer_violations(groups: tuple[Group, ...], rows: int, b: Bounds) -> tuple[Violation, ...]:
    """The buffer-level invariants depend on the groups and rows only, which many states share."""
    return tuple(check_invariants(buffer_snapshot(groups, rows, b)))


def check_state(s: SchedState, b: Bounds) -> list[Violation]:
    """Every invariant `s` breaks; empty when all hold."""
    out = [v for _, check in BY_FIELDS for v in check(s, b)]
    out += check_rest(s, b)
    return out


def _buffer_part(s: SchedState, b: Bounds) -> tuple[Violation, ...]:
    return _group_violations(s.groups, s.rows, s.pending, s.inflight, s.free_permits, b)


def _ledger_part(s: SchedState, b: Bounds) -> tuple[Violation, ...]:
    return tuple(_check_ledger(s, b))


Check = Callable[[SchedState, Bounds], tuple[Violation, ...]]

BY_FIELDS: tuple[tuple[frozenset[str], Check], ...] = (
    (frozenset({"groups", "rows", "pending", "inflight", "free_permits"}), _buffer_part),
    (
        frozenset(
            {
                "phase",
                "step",
                "cursor",
                "reissue",
                "groups",
                "trained",
                "trained_twice",
                "shortfall",
            }
        ),
        _ledger_part,
    ),
)
"""The first checks of `check_state`, each with the fields of the core it reads: the explorer
computes each once per value of its fields, which many cores share."""


def check_rest(s: SchedState, b: Bounds) -> tuple[Violation, ...]:
    """The checks of `check_state` after `BY_FIELDS`: demand dispatch and the exit, which read
    most of a state (and run on few states: with `demand`, or once the run is done)."""
    if not b.demand and s.phase is not _DONE:
        return ()
    out = []
    if b.demand:
        out += _check_demand(s, b)
    if s.phase is _DONE:
        out += _check_exit(s, b)
    return tuple(out)


def _group_violations(
    groups: tuple[Group, ...],
    rows: int,
    pending: tuple[tuple[int, ...], ...],
    inflight: tuple[tuple[tuple[int, ...], ...], ...],
    free: int,
    b: Bounds,
) -> tuple[Violation, ...]:
    """The invariants of the buffer, the queues and the permits: each family reads some of these
    fields only, and is computed once per value of them (the explorer's own memo already looks
    up the whole of these fields once per core)."""
    return (
        _buffer_violations(groups, rows, b)
        + _queue_violations(groups, pending, inflight, b)
        + _permit_violations(groups, free, b)
    )


@functools.lru_cache(maxsize=1 << 16)
def _queue_violations(
    groups: tuple[Group, ...],
    pending: tuple[tuple[int, ...], ...],
    inflight: tuple[tuple[tuple[int, ...], ...], ...],
    b: Bounds,
) -> tuple[Violation, ...]:
    """Queues and batches depend on these fields only, which many states share."""
    return tuple(_check_queues(groups, pending, inflight, b))


@functools.lru_cache(maxsize=1 << 16)
def _permit_violations(groups: tuple[Group, ...], free: int, b: Bounds) -> tuple[Violation, ...]:
    return tuple(_check_permits(groups, free, b))


def _check_queues(
    groups: tuple[Group, ...],
    pending: tuple[tuple[int, ...], ...],
    inflight: tuple[tuple[tuple[int, ...], ...], ...],
    b: Bounds,
) -> list[Violation]:
    out = []
    state = {g.ordinal: g for g in groups}
    queued = [o for q in pending for o in q]
    flying = [o for batches in inflight for batch in batches for o in batch]
    written: list[int] = []
    scoring: list[int] = []
    for o, g in state.items():
        if g.state is _WRITTEN:
            written.append(o)
        elif g.state is _SCORING:
            scoring.append(o)
    written.sort()
    scoring.sort()
    if sorted(queued) != written:
        out.append(Violation("queues", f"queued {sorted(queued)} but WRITTEN {written}"))
    if sorted(flying) != scoring:
        out.append(Violation("queues", f"in flight {sorted(flying)} but SCORING {scoring}"))
    for lane in range(b.lanes):
        members = [o for o in pending[lane]] + [o for x in inflight[lane] for o in x]
        wrong = [o for o in members if o in state and b.lane(o, state[o].stage) != lane]
        if wrong:
            out.append(Violation("routing", f"lane {lane} holds groups {wrong} of other lanes"))
        if len(inflight[lane]) > 1:
            out.append(
                Violation(
                    "one_batch_per_teacher",
                    f"lane {lane} has {len(inflight[lane])} calls in flight",
                )
            )
        for batch in inflight[lane]:
            if len(batch) > b.shape.max_batch_groups:
                out.append(
                    Violation("batch_size", f"lane {lane} batch {list(batch)} > max_batch_groups")
                )
    return out


def _check_permits(groups: tuple[Group, ...], free: int, b: Bounds) -> list[Violation]:
    out = []
    held = sum(g.permit for g in groups)
    if free < 0 or held + free != b.shape.max_inflight_prompts:
        out.append(
            Violation(
                "permits",
                f"{held} held + {free} free != {b.shape.max_inflight_prompts} (max_inflight_prompts)",
            )
        )
    if b.design is Design.PUMP or b.stages == 0:
        holders = [g.ordinal for g in groups if g.permit and g.state is not _S.RESERVED]
        if holders:
            out.append(Violation("permits", f"committed groups {holders} hold permits"))
    ready = [g.ordinal for g in groups if g.permit and g.state is _S.READY]
    if ready:
        out.append(Violation("permits", f"READY groups {ready} still hold permits"))
    return out


def _check_demand(s: SchedState, b: Bounds) -> list[Violation]:
    """Demand dispatch is prompt: a queue may send for "demand" exactly when training waits on
    the step of a group it holds, and nothing can still add to that step's part of it.

    With a flush timer (the only setting the pipeline runs) every waiting batch may go for
    "timer" at any moment, so a demand rule that fires late, never, or per teacher deadlocks
    nothing and the search would not see it: this property does. It restates the rule from the
    state alone, without `decisions.demand_dispatch`, so a bug in that one shared rule (which
    the pipeline's stage calls too) shows here whatever the timer does."""
    out = []
    for lane in range(b.lanes):
        due = _demand_due(s, b, lane)
        sent = DispatchReason.DEMAND in dispatch_reasons(s, b, lane)
        if due and not sent:
            out.append(
                Violation(
                    "demand",
                    f"training waits on step {s.step}, whose groups queued on lane {lane} can "
                    "no longer be joined by another, yet no batch is demanded there: it waits "
                    "for the flush timer",
                )
            )
        elif sent and not due:
            out.append(
                Violation(
                    "demand",
                    f"lane {lane} demands a batch while training does not wait on it: step "
                    f"{s.step} may still add groups there, or none of its groups is queued",
                )
            )
    return out


def _demand_due(s: SchedState, b: Bounds, lane: int) -> bool:
    if (
        b.design is Design.INLINE
        or b.sampler is Sampler.WINDOWED  # it waits on no step in particular
        or s.phase is not Phase.RUNNING
        or s.failed
        or s.cut is not None  # training pauses for the checkpoint
        or s.writing is not None
        or s.step >= b.steps
        or s.inflight[lane]
    ):
        return False
    step = range(
        b.shape.prompts_per_step * s.step, min(b.shape.prompts_per_step * (s.step + 1), b.prompts)
    )
    if not any(o in step for o in s.pending[lane]):
        return False
    if any(o >= s.cursor or o in s.reissue for o in step):
        return False  # a prompt of the step is still to be issued
    stage = b.stage_of_lane(lane)
    return not any(
        g.ordinal in step
        and (g.state is _S.RESERVED or (g.state in (_S.WRITTEN, _S.SCORING) and g.stage < stage))
        for g in s.groups
    )


def _check_ledger(s: SchedState, b: Bounds) -> list[Violation]:
    """No prompt trained twice, nor trained stale; while running, every issued prompt is
    somewhere."""
    out = []
    if b.sampler is Sampler.WINDOWED:
        stale = [
            g.ordinal
            for g in s.groups
            if g.state is _S.CONSUMED and s.step - g.version > b.max_staleness
        ]
        if stale:
            out.append(
                Violation("stale_trained", f"step {s.step} trains stale groups of prompts {stale}")
            )
    if s.trained_twice:
        out.append(
            Violation("trained_twice", f"prompts {list(_ordinals(s.trained_twice))} trained twice")
        )
    if s.phase is not Phase.RUNNING:
        return out  # cancelled or dropped prompts are re-issued from the exit checkpoint
    held_bits = reissue_bits = 0
    for g in s.groups:
        held_bits |= 1 << g.ordinal
    for o in s.reissue:
        reissue_bits |= 1 << o
    trained, shortfall = s.trained, s.shortfall
    issued = (1 << s.cursor) - 1
    union = held_bits | reissue_bits | trained | shortfall
    overlap = (
        held_bits & (reissue_bits | trained | shortfall)
        | reissue_bits & (trained | shortfall)
        | trained & shortfall
    )
    bad = (issued & ~union) | overlap  # lost, or in two places: the slow path names them
    held = {g.ordinal for g in s.groups} if bad else set()
    for o in _ordinals(bad):
        places = [
            name
            for name, here in (
                ("held", o in held),
                ("re-issue queue", o in s.reissue),
                ("trained", bool(s.trained >> o & 1)),
                ("given up", bool(s.shortfall >> o & 1)),
            )
            if here
        ]
        if len(places) != 1:
            what = "lost" if not places else "in " + " and ".join(places)
            out.append(Violation("prompt_ledger", f"prompt {o} is {what}"))
    if b.sampler is Sampler.IN_ORDER:
        for g in s.groups:
            if g.state is _S.READY and b.target(g.ordinal) < s.step:
                out.append(Violation("in_order", f"prompt {g.ordinal} READY behind step {s.step}"))
    return out


def _check_exit(s: SchedState, b: Bounds) -> list[Violation]:
    """The run exited: no group is live (none unready, and the READY ones left over dropped,
    so no row stays in the store), and every issued prompt is trained, given up, or to be
    issued again on resume, exactly one of these. What is to be issued again is the
    checkpoint's rule applied to the rest (`_ledger`); the run's own record of it (`s.reissue`:
    cancelled, dropped, or not admitted again since a restore) must agree, so a prompt the run
    forgot to record is caught here. A failed run may also leave prompts of a failed train step
    unrecorded: nothing trained them, and the rule issues them again."""
    out = []
    unready = [g.ordinal for g in s.groups if g.state is not _S.READY]
    if unready:
        out.append(Violation("drain_on_exit", f"exited with prompts {unready} unready"))
    held = [g.ordinal for g in s.groups if g.state is _S.READY]
    if held:
        out.append(Violation("drain_on_exit", f"exited with prompts {held} READY, rows kept"))
    ledger = _ledger(s, b)
    sets = {
        "trained": set(_ordinals(ledger.trained)),
        "given up": set(_ordinals(ledger.shortfall)),
        "re-issued on resume": set(ledger.reissue),
    }
    for o in range(ledger.cursor):
        places = [name for name, members in sets.items() if o in members]
        if len(places) != 1:
            what = "lost" if not places else "in " + " and ".join(places)
            out.append(Violation("exit_ledger", f"prompt {o} is {what} at exit"))
    recorded = set(s.reissue)
    unrecorded = sets["re-issued on resume"] - recorded
    if recorded - sets["re-issued on resume"] or (unrecorded and not s.failed):
        out.append(
            Violation(
                "exit_ledger",
                f"the run recorded prompts {sorted(recorded)} to issue again, the checkpoint's "
                f"rule gives {sorted(ledger.reissue)}",
            )
        )
    if s.stopped and not s.failed:
        missing = [o for o in range(b.prompts) if not (sets["trained"] | sets["given up"]) >= {o}]
        if missing:
            out.append(
                Violation("complete_run", f"run finished without training prompts {missing}")
            )
    return out
