"""Calibration: fit a scenario's latency models to what a real run traced, then check how well
the simulation of the fitted scenario reproduces the run.

`calibrate(RUN_DIR)` reads the run's `trace.jsonl` (and `metrics.jsonl` beside it, for the
weight sync's time), walking it through the model first (`groupflow replay`): a trace the model
rejects is not fitted. From the actions' times it fits:

- **generation**, three ways (`GENERATION_LAWS`): one engine serving a rollout at a time in
  arrival order (a rollout's time alone is the engine's busy time over the rollouts), rollouts
  side by side (their durations as they were), or one engine that batches (each rollout's
  time against the sequences its engine served meanwhile, as a slowdown curve, and the
  rollouts that started together drawing one time where they ended together). Each way the
  times alone are a lognormal with the spread and floor of those times.
- **each teacher and the verifier**: seconds per call against rows per call (least squares,
  `fixed_s + per_row_s * rows`), the rows read from the model's batches. Where a teacher's
  calls all had one size, the split between a call's fixed cost and its cost per row comes
  from the calls of other sizes timed before the run (`teacher-probe.json`), scaled to the
  run's own calls (`_with_probe`); without a probe a call costs its mean whatever its rows.
- **the train step**: `train` to `trained`, less the weight sync (`sync_s` in the metrics);
  a learner that keeps the event loop quiet for its whole computation becomes `blocks_loop`
  (as one in a worker thread does where nothing else is ready meanwhile).
- **the weight sync**, as one that freezes the rollouts in flight, and, where they all end
  inside it, as one that waits for them, the syncs that found none in flight costed apart
  where they cost otherwise (`_weight_sync`), and the rollouts it waits for slowed as much
  as the run's were (`_with_drain`).

Every way of reading generation is simulated with every way of reading the sync, each with
its drain, and the fit keeps the closest to the run (`_choose`).

The config, the routing and the stages come from the trace's header. `compare` puts the run's
own figures (seconds per step, teacher calls per step, rows per call, teacher seconds per step,
rollouts generating, permit-seconds held by scoring, sync) beside the simulation's.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl._pipeline import PipelineConfig, config_from_json, trace_path
from groupflow.impl._teachers import PROBE_FILE, read_probe
from groupflow.model.errors import TraceCorrupt, TraceNotFound
from groupflow.model.policy import Design, Dispatch
from groupflow.model.scheduler import Bounds, SchedState
from groupflow.model.scheduler.actions import ActionKind
from groupflow.sim.engines import EngineModel, WeightSyncModel
from groupflow.sim.run import SimResult, Variant, simulate
from groupflow.sim.scenario import GenerationModel, Scenario, TeacherModel
from groupflow.sim.spread import measured
from groupflow.sim.verify.replay import INCOMPLETE, bounds_of_header, replay

_FEWEST_ROLLOUTS = 5
"""A run with fewer finished rollouts is too short to fit generation to."""
_ROLLOUT_ENDS = frozenset({ActionKind.COMMIT, ActionKind.ROLLOUT_FAIL, ActionKind.CANCEL})
_CALL_ENDS = frozenset({ActionKind.SCORED, ActionKind.SCORE_FAIL})


@attrs.frozen
class Terms:
    """Where a step's seconds go, read the same way off a run's trace and off a simulation's:
    the three parts of a step add up to its seconds, and the last two say which model term
    (generation or scoring) the waiting comes from."""

    train_s: float
    """Per step: `train` to `trained`, less the weight sync."""
    sync_s: float
    """Per step: the weight sync."""
    waiting_s: float
    """Per step: the rest, the trainer waiting for the step's groups."""
    rollout_s: float
    """Mean seconds from a rollout's admission to its end (scoring included, inline)."""
    call_s: float
    """Mean seconds of a teacher call."""


def _terms(walk: _Walk, sync_s: float, teachers: int) -> Terms:
    steps = len(walk.steps)
    step = statistics.fmean(walk.steps)
    calls = [s for lane in range(teachers) for _, s in walk.calls.get(lane, [])]
    durations = [end - start for _, start, end in walk.intervals]
    return Terms(
        train_s=max(0.0, step - sync_s),
        sync_s=sync_s,
        waiting_s=walk.wall / steps - step,
        rollout_s=statistics.fmean(durations) if durations else 0.0,
        call_s=statistics.fmean(calls) if calls else 0.0,
    )


@attrs.frozen
class Observed:
    """What the run measured, in the units of `groupflow sim`'s report."""

    steps: int
    s_per_step: float
    calls_per_step: float
    """Calls of the first stage (the teachers)."""
    rows_per_call: float
    teacher_s_per_step: float
    generation_concurrency: float
    """Rollouts in flight, averaged over the run's time."""
    permit_s_per_step: float
    """Permit-seconds held by scoring: none in the pump design (the permit goes at commit);
    NaN for an inline run, whose trace does not say when scoring began."""
    sync_s_per_step: float
    terms: Terms


@attrs.frozen
class Calibration:
    scenario: Scenario
    observed: Observed
    notes: tuple[str, ...] = ()
    """The assumptions the fit made, in words."""


@attrs.define
class _Walk:
    """What the fit reads off the trace, action by action (`replay`'s `on_action`)."""

    generations: int
    incarnation: int = -1
    first: float = 0.0
    last: float = 0.0
    wall: float = 0.0
    now: float = 0.0
    admitted: dict[int, tuple[float, float]] = attrs.field(factory=dict)
    """Ordinal -> (admit time, the load-time integral then)."""
    load: int = 0
    integral: float = 0.0
    """The integral of the load (rollouts in flight) over time, this incarnation."""
    load_integral: float = 0.0
    """Over every incarnation."""
    rollouts: list[tuple[float, float]] = attrs.field(factory=list)
    """(duration, mean load over it) of each rollout that ended."""
    calls: dict[int, list[tuple[int, float]]] = attrs.field(factory=dict)
    """Lane -> (rows, seconds) of each call."""
    call_tokens: dict[int, list[int | None]] = attrs.field(factory=dict)
    """Lane -> the tokens of each of its `calls` (None where a group's are not known)."""
    tokens: dict[int, int] = attrs.field(factory=dict)
    """Prompt -> the tokens its latest commit recorded."""
    dispatched: dict[int, tuple[float, tuple[int, ...]]] = attrs.field(factory=dict)
    """Lane -> (dispatch time, the batch's ordinals) of the call in flight."""
    train_started: float | None = None
    steps: list[float] = attrs.field(factory=list)
    quiet: list[float] = attrs.field(factory=list)
    """Per train step: how long after its start the first other action happened (its whole
    length when none did). A learner that computes in the event loop's thread leaves the
    loop quiet for its whole computation."""
    _first_other: float | None = attrs.field(default=None, init=False)
    busy_time: float = 0.0
    """Time with at least one rollout in flight."""
    intervals: list[tuple[int, float, float]] = attrs.field(factory=list)
    """(incarnation, start, end) of each rollout that ended."""
    interval_tokens: list[int | None] = attrs.field(factory=list)
    """The tokens of each of `intervals` (its commit's; None where the trace has none)."""
    trained_at: dict[int, tuple[int, float]] = attrs.field(factory=dict)
    """Step -> (incarnation, time) of its `trained`: the end of its weight sync."""

    def on_action(self, data: Mapping[str, Any], before: SchedState, after: SchedState) -> None:
        time = float(data["time"])
        if data["incarnation"] != self.incarnation:
            self.close()
            self.incarnation = data["incarnation"]
            self.first = self.now = time
            self.admitted.clear()
            self.dispatched.clear()
            self.load = 0
            self.integral = 0.0
            self.train_started = None
        self.advance(time)
        kind = ActionKind(data["kind"])
        if (
            self.train_started is not None
            and kind is not ActionKind.TRAINED
            and self._first_other is None
        ):
            self._first_other = time - self.train_started
        if kind is ActionKind.ADMIT:
            self.admitted[data["ordinal"]] = (time, self.integral)
            self.load += 1
        elif kind in _ROLLOUT_ENDS and data["ordinal"] in self.admitted:
            began, integral = self.admitted.pop(data["ordinal"])
            duration = time - began
            tokens = data.get("tokens") if kind is ActionKind.COMMIT else None
            if type(tokens) is not int or tokens < 1:
                tokens = None  # none recorded, or rows without token ids
            else:
                self.tokens[data["ordinal"]] = tokens
            self.intervals.append((self.incarnation, began, time))
            self.interval_tokens.append(tokens)
            if duration > 0:
                self.rollouts.append((duration, (self.integral - integral) / duration))
            self.load -= 1
        elif kind is ActionKind.DISPATCH:
            batch = after.inflight[data["lane"]][-1]
            self.dispatched[data["lane"]] = (time, batch)
        elif kind in _CALL_ENDS and data["lane"] in self.dispatched:
            began, batch = self.dispatched.pop(data["lane"])
            self.calls.setdefault(data["lane"], []).append(
                (len(batch) * self.generations, time - began)
            )
            known = [self.tokens[o] for o in batch if o in self.tokens]
            self.call_tokens.setdefault(data["lane"], []).append(
                sum(known) if len(known) == len(batch) else None
            )
        elif kind is ActionKind.TRAIN:
            self.train_started = time
            self._first_other = None
        elif kind is ActionKind.TRAINED and self.train_started is not None:
            step = str(data.get("detail", "")).removeprefix("step ")
            if step.isdigit():
                self.trained_at[int(step)] = (self.incarnation, time)
            self.steps.append(time - self.train_started)
            self.quiet.append(
                time - self.train_started if self._first_other is None else self._first_other
            )
            self.train_started = None

    def advance(self, time: float) -> None:
        dt = time - self.now
        if dt > 0:
            if self.load:
                self.busy_time += dt
            self.integral += self.load * dt
            self.load_integral += self.load * dt
        self.now = self.last = time

    def close(self) -> None:
        if self.incarnation >= 0:
            self.wall += self.last - self.first


def _read_header(trace: Path) -> dict[str, Any]:
    """The header line of the trace at `trace`, or `TraceNotFound` / `TraceCorrupt` naming the
    file: whatever the path holds (nothing, a folder, an empty, binary or text file, JSON that
    is not a header) is judged before anything is fitted."""
    if not trace.is_file():
        raise TraceNotFound(
            f"{str(trace)!r} is not a trace file: give groupflow train's run folder or the "
            f"trace.jsonl a run wrote"
        )
    with trace.open("rb") as f:
        first = f.readline()
    try:
        header = json.loads(first.decode("utf-8")) if first.strip() else None
    except ValueError:  # not UTF-8, or not JSON
        header = None
    if not isinstance(header, dict) or header.get("type") != "header":
        found = "the file is empty" if not first else f"it starts {first[:60]!r}"
        raise TraceCorrupt(
            f"{trace}: line 1 is not a groupflow trace header (JSON lines starting with "
            f'{{"type": "header", ...}}): {found}'
        )
    return header


def _sync_seconds(run: Path) -> dict[int, float]:
    """The weight syncs' seconds by step, from the run's `metrics.jsonl`, if it has one. A line that
    does not read as a step's record is refused, naming the file and the line, but for a last
    line cut short (the process died writing it)."""
    metrics = run / "metrics.jsonl" if run.is_dir() else run.parent / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    text = metrics.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    out: dict[int, float] = {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError("not an object")
            if not record.get("skipped") and "sync_s" in record:
                out[int(record.get("step", len(out)))] = float(record["sync_s"])
        except (ValueError, TypeError) as exc:
            if number == len(lines) and not text.endswith("\n"):
                continue  # cut short as the process died: the steps before it are whole
            raise TraceCorrupt(
                f"{metrics}: line {number} is not a step's record ({exc}): {line[:60]!r}"
            ) from None
    return out


_WAITS = 0.8
"""The share of syncs (among those that met rollouts in flight) whose rollouts all ended inside
the sync for the fit to read the sync as one that waits for them."""


def _weight_sync(walk: _Walk, syncs: Mapping[int, float]) -> list[tuple[str, WeightSyncModel]]:
    """The ways to read the weight sync: always as one that freezes the rollouts in flight for
    its whole time (`interrupt`); and, where the rollouts in flight all ended inside most syncs
    that met some (a served engine's `/pause?mode=wait` does that), as one that waits for them
    and then costs its time after the last of them (`wait`). A sync that found none in flight
    is fitted apart (`idle_s`): a served engine that drained requests takes several times
    longer to resume than one that had none."""
    met = waited = 0
    own: list[float] = []
    idle: list[float] = []
    for seconds, _, end, ends in _syncs_met(walk, syncs):
        if ends:
            met += 1
        if not ends:
            idle.append(seconds)
        elif max(ends) <= end:
            waited += 1
            own.append(end - max(ends))
        else:
            own.append(seconds)
    ways = [("interrupt", _sync_model(list(syncs.values()), "interrupt"))]
    if met and waited >= _WAITS * met:
        if len(idle) < _FEWEST_IDLE or len(own) < 2 or not _differ(own, idle):
            ways.append(("wait", _sync_model(own + idle, "wait")))
        else:
            busy = _sync_model(own, "wait")
            alone = _mean_and_spread(idle)
            ways.append(("wait", attrs.evolve(busy, idle_s=alone[0], idle_spread=alone[1])))
    return ways


def _pooled_syncs(walk: _Walk, syncs: Mapping[int, float], kept: WeightSyncModel) -> str | None:
    """Where the syncs that met rollouts in flight cost otherwise than those that met none
    and the `kept` sync freezes the rollouts, with one cost for both: what that hides from a
    prediction of the other design, which meets rollouts at more or fewer of its syncs. None
    where they cost alike, and for a sync that waits: it simulates the wait itself, and fits
    the time after it apart where that differs (`_weight_sync`)."""
    if kept.mode != "interrupt":
        return None
    busy: list[float] = []
    idle: list[float] = []
    for seconds, _, _, ends in _syncs_met(walk, syncs):
        (busy if ends else idle).append(seconds)
    if min(len(busy), len(idle)) < _FEWEST_IDLE or not _differ(busy, idle):
        return None
    return (
        f"weight sync: {len(busy) / (len(busy) + len(idle)):.0%} of the syncs met rollouts in "
        f"flight and took {statistics.fmean(busy):.3f} s on average, the others "
        f"{statistics.fmean(idle):.3f} s; the fit keeps one cost for both, so a design that "
        f"meets rollouts at more of its syncs costs more per sync than its prediction says, "
        f"one that meets them at fewer less"
    )


def _syncs_met(
    walk: _Walk, syncs: Mapping[int, float]
) -> list[tuple[float, float, float, list[float]]]:
    """Each sync of the run: its seconds, its start and end, and the ends of the rollouts in
    flight at its start."""
    by_incarnation: dict[int, list[tuple[float, float]]] = {}
    for incarnation, start, end in walk.intervals:
        by_incarnation.setdefault(incarnation, []).append((start, end))
    out = []
    for step, seconds in syncs.items():
        if step not in walk.trained_at:
            continue
        incarnation, end = walk.trained_at[step]
        begin = end - seconds
        ends = [e for s, e in by_incarnation.get(incarnation, []) if s < begin < e]
        out.append((seconds, begin, end, ends))
    return out


def _drains(walk: _Walk, syncs: Mapping[int, float]) -> list[float]:
    """Per sync that met rollouts in flight and waited for them: how long after its start
    the last of them ended."""
    return [
        max(ends) - begin
        for _, begin, end, ends in _syncs_met(walk, syncs)
        if ends and max(ends) <= end
    ]


_DRAIN_ROUNDS = 6
"""Drains `_with_drain` simulates, at most."""
_MOST_DRAIN = 8.0
"""The slowest drain `_with_drain` tries."""


def _with_drain(
    scenario: Scenario,
    walk: _Walk,
    syncs: Mapping[int, float],
    refit: Callable[[_Walk], tuple[GenerationModel, EngineModel]],
) -> Scenario:
    """`scenario`, whose sync waits for the rollouts in flight on a batching engine, with
    their drain as slow as the run's (`WeightSyncModel.drain`), where the run's drains (how
    long after a sync's start its rollouts end) outlast the simulation's by more than their
    spreads explain (`_differ`, with `_FEWEST_IDLE` or more on each side).

    Each drain tried fits generation again (`refit`) to the rollouts' times less what that
    drain cost them, which the simulation adds back; so a slower drain also makes every
    rollout's own time shorter, and the simulated drains grow slowly with it. The search
    brackets the run's mean drain between 1 and `_MOST_DRAIN` (doubling until the simulation
    outlasts it), then narrows by false position, or by the geometric midpoint where that would
    barely move; the drain whose simulated mean comes closest is kept."""
    sync = scenario.weight_sync
    if sync is None or sync.mode != "wait" or not scenario.engines.batching:
        return scenario
    run = _drains(walk, syncs)
    if len(run) < _FEWEST_IDLE:
        return scenario
    simulated = _simulated_drains(scenario)
    if len(simulated) < _FEWEST_IDLE:
        return scenario
    target, mean = statistics.fmean(run), statistics.fmean(simulated)
    if mean >= target or not _differ(run, simulated):
        return scenario
    low, below = 1.0, mean - target
    high: tuple[float, float] | None = None
    best = (abs(below), scenario)
    drain = min(target / mean, _MOST_DRAIN)
    for _ in range(_DRAIN_ROUNDS):
        generation, engines = refit(_unfrozen(walk, syncs, lost=1 - 1 / drain))
        fitted = attrs.evolve(
            scenario,
            generation=generation,
            engines=engines,
            weight_sync=attrs.evolve(sync, drain=round(drain, 6)),
        )
        simulated = _simulated_drains(fitted)
        if len(simulated) < _FEWEST_IDLE:
            break
        error = statistics.fmean(simulated) - target
        if abs(error) < best[0]:
            best = (abs(error), fitted)
        if error < 0:
            low, below = drain, error
        else:
            high = (drain, error)
        if high is None:
            if drain >= _MOST_DRAIN:
                break  # slower than any drain tried: the slowest is kept
            drain = min(drain * 2, _MOST_DRAIN)
            continue
        top, above = high
        guess = low + (top - low) * -below / (above - below)
        margin = 0.1 * (top - low)
        # false position, unless it would barely move from an end of the bracket
        drain = guess if low + margin < guess < top - margin else math.sqrt(low * top)
    return best[1]


def _simulated_drains(scenario: Scenario) -> list[float]:
    """`_drains` of `scenario`'s simulation, read off its own trace as the run's are."""
    with tempfile.TemporaryDirectory(prefix="groupflow-drains-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        steps = min(scenario.steps, _CHOOSE_STEPS)
        result = simulate(scenario, variant_of(scenario.pipeline), steps=steps, trace=trace)
        if result.outcome != "ok" or result.stalls:
            return []
        _, _, walk = _walked(trace)
    syncs = {
        int(span.detail.split(",")[0].removeprefix("version ")) - 1: span.end - span.start
        for span in result.spans
        if span.kind == "sync"
    }
    return _drains(walk, syncs)


_FEWEST_IDLE = 10
"""Syncs that found no rollout in flight, at least, for their seconds to be fitted apart."""
_APART = 3.0
"""How many standard errors apart two means must be for the fit to keep them apart."""


def _differ(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the means of `a` and `b` differ by more than their spreads explain (Welch's
    statistic over `_APART`): two costs fitted apart from noise would each be noisier."""
    error = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    gap = abs(statistics.fmean(a) - statistics.fmean(b))
    return gap > _APART * error if error else gap > 0


def _sync_model(seconds: Sequence[float], mode: str) -> WeightSyncModel:
    """A sync of `mode` costing these seconds: their mean, and their spread around it."""
    mean, spread = _mean_and_spread(seconds)
    return WeightSyncModel(fixed_s=mean, mode=mode, spread=spread)


def _mean_and_spread(seconds: Sequence[float]) -> tuple[float, tuple[float, ...]]:
    mean = statistics.fmean(seconds)
    return round(mean, 9), measured([s / mean for s in seconds]) if mean else ()


_SAME_ROWS = 0.9
"""Points whose most common size is at least this share of them do not vary in size."""


def _varies(sizes: Sequence[float]) -> bool:
    return bool(sizes) and max(map(sizes.count, set(sizes))) < _SAME_ROWS * len(sizes)


def _unfrozen(walk: _Walk, syncs: Mapping[int, float], lost: float = 1.0) -> _Walk:
    """`walk` with each rollout's time less `lost` of the weight syncs it overlapped: what it
    took generating, where a sync freezes the rollouts in flight (`interrupt`, all of it
    lost) or slows them (`drain`, `1 - 1 / drain` of it lost), as their simulation does
    again. A rollout that started inside a sync waited for it: all of that is lost."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for step, seconds in syncs.items():
        if step in walk.trained_at:
            incarnation, end = walk.trained_at[step]
            windows.setdefault(incarnation, []).append((end - seconds, end))
    rollouts = []
    ended = (interval for interval in walk.intervals if interval[2] > interval[1])
    for (duration, load), (incarnation, start, end) in zip(walk.rollouts, ended, strict=True):
        frozen = sum(
            max(0.0, min(end, e) - max(start, b)) * (lost if start <= b else 1.0)
            for b, e in windows.get(incarnation, [])
        )
        rollouts.append((max(duration - frozen, duration * 1e-3), load))
    return attrs.evolve(walk, rollouts=rollouts)


def _line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """`(fixed, per_row)` of `seconds = fixed + per_row * rows`, both >= 0."""
    rows = [float(r) for r, _ in points]
    secs = [s for _, s in points]
    mean_s = statistics.fmean(secs)
    if not _varies(rows):  # a slope the points cannot show is taken as flat
        return max(0.0, mean_s), 0.0
    slope, intercept = statistics.linear_regression(rows, secs)
    if slope < 0 or intercept < 0:
        # a negative part fits noise: keep the one that stays, through the mean
        if slope <= 0:
            return max(0.0, mean_s), 0.0
        return 0.0, mean_s / statistics.fmean(rows)
    return intercept, slope


def _nonnegative_fit(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """The least-squares coefficients of `y` on `columns`, each >= 0: a negative one fits
    noise, so the most negative is dropped (its coefficient 0) and the rest fitted again."""
    kept = list(range(len(columns)))
    out = [0.0] * len(columns)
    while kept:
        coefficients = _least_squares([columns[i] for i in kept], y)
        worst = min(range(len(kept)), key=coefficients.__getitem__)
        if coefficients[worst] >= 0:
            for i, c in zip(kept, coefficients, strict=True):
                out[i] = c
            return out
        kept.pop(worst)
    return out


def _least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """The coefficients minimising the squared error of `y` against `columns` (the normal
    equations, by elimination); a column the others explain gets 0."""
    n = len(columns)
    matrix = [
        [math.fsum(a * b for a, b in zip(ci, cj, strict=True)) for cj in columns]
        + [math.fsum(a * b for a, b in zip(ci, y, strict=True))]
        for ci in columns
    ]
    for k in range(n):
        pivot = max(range(k, n), key=lambda r: abs(matrix[r][k]))
        matrix[k], matrix[pivot] = matrix[pivot], matrix[k]
        scale = abs(matrix[k][k])
        if scale <= 1e-12 * max(1.0, max(abs(v) for v in matrix[k][:n])):
            matrix[k] = [0.0] * (n + 1)
            continue
        for r in range(n):
            if r != k and matrix[r][k]:
                ratio = matrix[r][k] / matrix[k][k]
                matrix[r] = [a - ratio * b for a, b in zip(matrix[r], matrix[k], strict=True)]
    return [row[n] / row[k] if row[k] else 0.0 for k, row in enumerate(matrix)]


def _explains(
    columns: Sequence[Sequence[float]], extra: Sequence[float], y: Sequence[float]
) -> bool:
    """Whether the column `extra` explains `y` beyond `columns`: the squared error it removes
    is more than `_APART` squared times what is left per point (its t statistic over
    `_APART`), so that a term fitted to noise is not kept."""
    with_extra = [*columns, extra]
    before = _residual(columns, _least_squares(columns, y), y)
    after = _residual(with_extra, _least_squares(with_extra, y), y)
    left = len(y) - len(with_extra)
    if left < 1:
        return False
    return before - after > _APART**2 * after / left


def _residual(
    columns: Sequence[Sequence[float]], coefficients: Sequence[float], y: Sequence[float]
) -> float:
    """The squared error of `y` against `columns` weighted by `coefficients`."""
    return math.fsum(
        (v - math.fsum(c[i] * k for c, k in zip(columns, coefficients, strict=True))) ** 2
        for i, v in enumerate(y)
    )


_TOKENS_APART = 0.05
"""Calls whose tokens per row vary less than this (coefficient of variation) carry tokens in
proportion to their rows: a cost per token does not show apart from the cost per row."""


def _tokens_apart(points: Sequence[tuple[float, float]], tokens: Sequence[int | None]) -> bool:
    """Every call's tokens are known, and they tell something its rows do not."""
    if not tokens or any(t is None for t in tokens):
        return False
    per_row = [t / r for t, (r, _) in zip(tokens, points, strict=True) if t and r]
    return len(per_row) > 2 and statistics.pstdev(per_row) >= _TOKENS_APART * statistics.fmean(
        per_row
    )


def _teacher(
    points: Sequence[tuple[float, float]], tokens: Sequence[int | None] = ()
) -> TeacherModel:
    """The line through the calls' times against their rows, and their spread around it; where
    the calls' tokens vary apart from their rows, the plane through their times against rows
    and tokens (`_tokens_apart`)."""
    fixed, per_row, per_token = (*_line_fit(points), 0.0)
    if _tokens_apart(points, tokens):
        rows = [float(r) for r, _ in points]
        seconds = [s for _, s in points]
        counts = [float(t or 0) for t in tokens]
        # calls of one size: the rows show no cost of their own
        columns = [[1.0] * len(points), rows if _varies(rows) else [0.0] * len(points)]
        if _explains(columns, counts, seconds):
            fixed, per_row, per_token = _nonnegative_fit([*columns, counts], seconds)
    predicted = [
        (fixed + per_row * rows + per_token * (t or 0), s)
        for (rows, s), t in zip(points, tokens or [0] * len(points), strict=True)
    ]
    return TeacherModel(
        dp=1,
        fixed_s=round(fixed, 9),
        per_row_s=round(per_row, 9),
        per_token_s=round(per_token, 12),
        spread=measured([s / p for p, s in predicted if p > 0]),
    )


def _with_probe(
    teacher: TeacherModel, rows: int, seconds: float, probe: Sequence[tuple[int, float]]
) -> TeacherModel:
    """`teacher`, fitted to calls of `rows` rows (nearly) only, with the probe's split of a
    call's cost between its fixed part and its rows, scaled so that a call of `rows` rows
    costs `seconds`, the mean of the run's calls of that size: the probe's calls ran with the
    engines otherwise idle, the run's beside its rollouts, so only the split carries over.
    The line goes through each size's median call: one call that met the server busy with
    something else (a probe's first, or one beside a previous run's leftovers) would tilt a
    line through them all. As it was where the probe shows no cost per row."""
    by_rows: dict[int, list[float]] = {}
    for size, took in probe:
        by_rows.setdefault(size, []).append(took)
    fixed, per_row = _line_fit(
        [(size, statistics.median(times)) for size, times in sorted(by_rows.items())]
    )
    at_rows = fixed + per_row * rows
    if not per_row or at_rows <= 0:
        return teacher
    scale = seconds / at_rows
    return attrs.evolve(
        teacher, fixed_s=round(fixed * scale, 9), per_row_s=round(per_row * scale, 9)
    )


def _probe_calls(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Per teacher, the (rows, seconds) of its calls timed before the run, where the run
    folder has them."""
    path = trace_path(run).parent / PROBE_FILE
    if not path.exists():
        return {}
    out: dict[str, list[tuple[int, float]]] = {}
    for call in read_probe(path):
        out.setdefault(call.teacher, []).append((call.rows, call.seconds))
    return out


_FLAT_TOKENS = 0.02
"""Groups whose tokens spread less than this (sigma of the log) hardly vary: no time is read
against them, and the fitted scenario draws none."""


@attrs.frozen
class _Tokens:
    """What the fit reads of the groups' tokens: their lognormal (`GenerationModel.tokens`,
    `tokens_sigma`), and the share of a rollout's time that grows with them."""

    median: float
    sigma: float
    share: float = 0.0

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def factor(self, tokens: int | None) -> float:
        """How much longer than its draw a rollout of `tokens` takes (as the simulation has it:
        `GenerationModel.seconds`)."""
        if tokens is None or not self.share:
            return 1.0
        return 1 - self.share + self.share * tokens / self.mean

    def of(self, times: Sequence[float], counts: Sequence[int | None]) -> _Tokens:
        """These tokens with the share of `times` (one per count) that grows with them: the
        line through the times against the tokens, as a share of its value at the mean."""
        if not self.sigma:  # tokens of one size tell nothing of time
            return self
        points = [(float(t), s) for t, s in zip(counts, times, strict=True) if t]
        tokens = [t for t, _ in points]
        seconds = [s for _, s in points]
        if len(points) < 3 or not _explains([[1.0] * len(points)], tokens, seconds):
            return self
        slope, intercept = statistics.linear_regression(tokens, seconds)
        at_mean = intercept + slope * self.mean
        share = 0.0 if at_mean <= 0 else min(1.0, max(0.0, slope * self.mean / at_mean))
        return attrs.evolve(self, share=round(share, 6))

    def model(self, generation: GenerationModel) -> GenerationModel:
        """`generation` drawing these tokens, with their share of its time."""
        return attrs.evolve(
            generation, tokens=self.median, tokens_sigma=self.sigma, token_share=self.share
        )


def _tokens(walk: _Walk) -> _Tokens | None:
    """The groups' tokens as a lognormal, from the commits that recorded them (None where
    too few did); where they hardly vary (`_FLAT_TOKENS`), their median alone, so that a
    what-if that prices tokens prices the run's."""
    counts = [t for t in walk.interval_tokens if t]
    if len(counts) < _FEWEST_ROLLOUTS:
        return None
    logs = [math.log(t) for t in counts]
    sigma = statistics.pstdev(logs)
    median = round(math.exp(statistics.fmean(logs)), 3)
    return _Tokens(median, 0.0) if sigma < _FLAT_TOKENS else _Tokens(median, round(sigma, 6))


def _rollout_tokens(walk: _Walk) -> list[int | None]:
    """The tokens of each of `walk.rollouts` (the rollouts that took some time)."""
    if not walk.interval_tokens:  # a walk made by hand, without its rollouts' tokens
        return [None] * len(walk.rollouts)
    return [
        t
        for (_, start, end), t in zip(walk.intervals, walk.interval_tokens, strict=True)
        if end > start
    ]


def _period(routing: Sequence[int]) -> int:
    """The shortest period of the routing (a scenario routes prompt `o` by `o % agents`)."""
    for p in range(1, len(routing) + 1):
        if all(routing[i] == routing[i % p] for i in range(len(routing))):
            return p
    return len(routing)  # pragma: no cover - p == len always matches


def _log_spread(times: Sequence[float]) -> float:
    """The spread of `times` (sigma of the log); 0 for fewer than two."""
    logs = [math.log(t) for t in times if t > 0]
    return statistics.pstdev(logs) if len(logs) > 1 else 0.0


def _lognormal(bases: Sequence[float], mean: float) -> GenerationModel:
    """A lognormal with the spread of `bases` and the given mean (what sets the throughput)."""
    sigma = _log_spread(bases)
    return GenerationModel(
        median_s=mean / math.exp(sigma**2 / 2), sigma=sigma, min_s=min(bases) if bases else 0.0
    )


GENERATION_LAWS = ("shared", "parallel", "batching")
"""How the fit reads the run's rollouts: on one engine that serves them one at a time (their
times add up: the trainer's generator samples under one lock), each on its own (their times
overlap freely), or on one engine that batches the sequences it serves, each slower the more
it shares the engine with (a served engine: vLLM's continuous batching)."""


def _generation(
    walk: _Walk,
    generations: int,
    inflight: int,
    sync_total: float,
    law: str,
    tokens: _Tokens | None = None,
) -> tuple[GenerationModel, EngineModel]:
    if len(walk.rollouts) < _FEWEST_ROLLOUTS:
        raise TraceCorrupt(
            f"the trace has too few finished rollouts to fit generation ({len(walk.rollouts)}): "
            f"calibrate from a longer run"
        )
    counts = _rollout_tokens(walk)
    if law == "parallel":
        durations = [d for d, _ in walk.rollouts]
        return _scaled(durations, counts, statistics.fmean(durations), tokens), EngineModel()
    if law == "batching":
        return _batching(walk, generations, inflight, tokens=tokens)
    # one engine, one rollout at a time: it is busy whenever a rollout is in flight, except
    # while a weight sync holds it; each rollout's own time is its share of that
    busy = max(walk.busy_time - sync_total, 1e-9)
    alone = busy / len(walk.rollouts)
    pairs = [(d / c, t) for (d, c), t in zip(walk.rollouts, counts, strict=True) if c > 0]
    engines = EngineModel(engines=1, batching=False)
    return _scaled([b for b, _ in pairs], [t for _, t in pairs], alone, tokens), engines


def _scaled(
    bases: Sequence[float], counts: Sequence[int | None], mean: float, tokens: _Tokens | None
) -> GenerationModel:
    """`_lognormal` of `bases`, where tokens are fitted each over its tokens' factor (its
    share of the spread is the tokens')."""
    if tokens is None:
        return _lognormal(bases, mean)
    tokens = tokens.of(bases, counts)
    own = [b / tokens.factor(t) for b, t in zip(bases, counts, strict=True)]
    return tokens.model(_lognormal(own, mean))


_LOCKSTEP = 0.5
"""Rollouts that started together whose times spread less than this share of all the times'
spread (sigma of the log) ended together: the fit draws one time for them (`lockstep`)."""
_TOGETHER_S = 0.01
"""Rollouts admitted within this many seconds of each other started together."""
_FLAT_LOAD = 0.1
"""A run whose engine load varied less than this (coefficient of variation) cannot show how a
sequence slows with its engine's load."""


def _spread_within_starts(walk: _Walk, tokens: _Tokens | None = None) -> float:
    """The spread (sigma of the log) of the times of rollouts that started together, pooled:
    a batching engine finishes rollouts that started together together, and the spread of a
    run's times from one step to the next (the machine's other work) is not theirs. Where
    tokens are fitted, each time is over its tokens' factor: that spread is the tokens'."""
    deviations: list[float] = []
    batch: list[float] = []
    last = (-1, -math.inf)

    def close() -> None:
        if len(batch) > 1:
            mean = statistics.fmean(batch)
            deviations.extend(x - mean for x in batch)
        batch.clear()

    counts = walk.interval_tokens or [None] * len(walk.intervals)
    factors = [1.0 if tokens is None else tokens.factor(t) for t in counts]
    for (incarnation, start, end), factor in sorted(zip(walk.intervals, factors, strict=True)):
        if incarnation != last[0] or start - last[1] > _TOGETHER_S:
            close()
        if end > start:
            batch.append(math.log((end - start) / factor))
        last = (incarnation, start)
    close()
    if len(deviations) < 2:
        return 0.0
    return math.sqrt(statistics.fmean(d * d for d in deviations))


def _batching(
    walk: _Walk, generations: int, inflight: int, *, tokens: _Tokens | None = None
) -> tuple[GenerationModel, EngineModel]:
    """One engine that batches: a rollout's time against the sequences its engine served
    meanwhile (least squares, `fixed + per_sequence * sequences`), as a slowdown curve over a
    sequence's time alone (flat when the load hardly varied: the run cannot show the slope);
    the bases are the times divided by their slowdown, spread as the times of rollouts that
    started together are, one draw for them all (`lockstep`) where they ended together (their
    spread under `_LOCKSTEP` of all the times') and the groups' tokens do not vary; where
    tokens are fitted, their share of a rollout's time is read off the bases."""
    points = [(c * generations, d) for d, c in walk.rollouts if c > 0]
    counts = [t for (_, c), t in zip(walk.rollouts, _rollout_tokens(walk), strict=True) if c > 0]
    loads = [n for n, _ in points]
    flat = statistics.pstdev(loads) < _FLAT_LOAD * statistics.fmean(loads)
    fixed, per = (1.0, 0.0) if flat else _line_fit(points)
    alone = fixed + per
    top = float(max(inflight * generations, 2))
    engines = EngineModel(
        engines=1,
        batching=True,
        slowdown=((1.0, 1.0),)
        if alone <= 0 or per == 0
        else ((1.0, 1.0), (top, round((fixed + per * top) / alone, 6))),
    )
    bases = [d / engines.factor(round(n)) for n, d in points]
    mean = statistics.fmean(bases)
    if tokens is not None:
        tokens = tokens.of(bases, counts)
        bases = [b / tokens.factor(t) for b, t in zip(bases, counts, strict=True)]
    sigma = _spread_within_starts(walk, tokens)
    if (tokens is None or not tokens.sigma) and sigma < _LOCKSTEP * _log_spread(bases):
        engines = attrs.evolve(engines, lockstep=True)
    generation = GenerationModel(
        median_s=mean / math.exp(sigma**2 / 2), sigma=sigma, min_s=min(bases)
    )
    return (generation if tokens is None else tokens.model(generation)), engines


def _walked(run: Path) -> tuple[dict[str, Any], Bounds, _Walk]:
    """The header of the trace at `run`, the model's bounds for it, and what the fit reads off
    it; `TraceCorrupt` for a trace the model rejects or that trained no step."""
    trace = trace_path(run)
    header = _read_header(trace)
    bounds = bounds_of_header(header)
    walk = _Walk(generations=bounds.shape.num_generations_per_prompt)
    verdict = replay(run, on_action=walk.on_action)
    stopped = verdict.incarnations and verdict.incarnations[-1].outcome == "stopped"
    if not (verdict.ok or (verdict.verdict == INCOMPLETE and stopped)):
        raise TraceCorrupt(
            f"{trace}: line {verdict.line}: cannot fit this trace ({verdict.verdict_line()}); "
            f"calibrate from a run `groupflow replay` finds valid, or one its user stopped"
        )
    walk.close()
    if not walk.steps:
        raise TraceCorrupt(f"{trace}: the run trained no step: nothing to calibrate from")
    return header, bounds, walk


def simulated_terms(
    scenario: Scenario, variant: Variant, *, seed: int = 0, steps: int | None = None
) -> tuple[SimResult, Terms]:
    """Simulate `variant` of `scenario` and read its `Terms` off the simulation's own trace,
    as `calibrate` reads the run's: one reading for both sides of the comparison."""
    with tempfile.TemporaryDirectory(prefix="groupflow-terms-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        result = simulate(scenario, variant, seed=seed, steps=steps, trace=trace)
        if result.outcome != "ok" or result.stalls:
            return result, Terms(*(math.nan,) * 5)
        _, bounds, walk = _walked(trace)
    sync_s = result.sync_s / len(walk.steps)
    return result, _terms(walk, sync_s, bounds.teachers)


def calibrate(run: Path) -> Calibration:
    """Fit a scenario to the run at `run` (a run folder, or its trace file): see the module
    docstring. Raises `TraceCorrupt` for a trace the model rejects or too short to fit."""
    run = Path(run)
    trace = trace_path(run)
    header, bounds, walk = _walked(run)
    generations = bounds.shape.num_generations_per_prompt
    notes: list[str] = []
    config = config_from_json(header["config"])
    if not isinstance(header.get("lanes"), dict):
        raise TraceCorrupt(f"{trace}: the header names no lanes (teacher -> queue): not a run's")
    lanes: dict[str, int] = dict(header["lanes"])
    names = {lane: name for name, lane in lanes.items()}
    tokens = _tokens(walk)
    call_tokens = walk.call_tokens if tokens is not None else {}
    """A call's tokens cost only what the simulation's groups carry (`GenerationModel`)."""
    teachers = {
        names[lane]: _teacher(walk.calls.get(lane, [(0, 0.0)]), call_tokens.get(lane, ()))
        for lane in range(bounds.teachers)
    }
    probe = _probe_calls(run)
    for lane in range(bounds.teachers):
        calls = walk.calls.get(lane, [])
        rows = [r for r, _ in calls]
        if not rows or _varies(rows):
            continue
        name, size = names[lane], statistics.mode(rows)
        timed = probe.get(name, [])
        split = teachers[name]
        if _varies([r for r, _ in timed]) and not split.per_token_s:
            mean_s = statistics.fmean(s for r, s in calls if r == size)
            split = teachers[name] = _with_probe(split, size, mean_s, timed)
        if split.per_row_s:
            sizes = sorted({r for r, _ in timed})
            notes.append(
                f"teacher {name}: its calls had {size} rows (all or nearly); the calls of "
                f"{sizes[0]} to {sizes[-1]} rows timed before the run split one into "
                f"{split.fixed_s:.3g} s and {split.per_row_s:.3g} s a row ({PROBE_FILE})"
            )
        else:
            notes.append(
                f"teacher {name}: its calls had {size} rows (all or nearly): a cost per row "
                f"does not show, and a call costs its mean whatever its rows; a what-if whose "
                f"calls have other sizes (the other design's) rests on that"
            )
    verifier = None
    if bounds.stages == 2:
        lane = bounds.teachers
        verifier = _teacher(walk.calls.get(lane, [(0, 0.0)]), call_tokens.get(lane, ()))
    routing: list[int] = list(header["routing"])
    period = _period(routing) if routing else 1
    width = len(str(period))
    agents = (
        {f"agent{i:0{width}d}": names[routing[i]] for i in range(period)}
        if routing
        else {"default": "teacher"}
    )
    if period > 16:
        notes.append(f"routing: prompts cycle through {period} agents")
    syncs = _sync_seconds(run)
    sync_s = statistics.fmean(syncs.values()) if syncs else 0.0
    syncing: list[tuple[str, WeightSyncModel | None]] = [("free", None)]
    if syncs:
        syncing = list(_weight_sync(walk, syncs))
    else:
        notes.append("weight sync: no metrics.jsonl with sync_s beside the trace; taken as free")
    train_s = max(0.0, statistics.fmean(walk.steps) - sync_s)
    quiet = statistics.median(walk.quiet)
    blocks = train_s > 0 and quiet >= 0.8 * train_s
    if blocks:
        notes.append(
            f"train: the event loop stays quiet for {quiet * 1e3:.1f} ms of each step (median), "
            f"the learner's whole {train_s * 1e3:.1f} ms, as a learner that computes in the "
            f"loop's thread keeps it: simulated as one (blocks_loop: the tasks ready at the "
            f"step's start run, then none until it ends); a learner in a worker thread with "
            f"nothing else ready meanwhile looks the same"
        )
    fitted = Scenario(
        name=f"fitted-{run.resolve().name}",
        description=f"Fitted by groupflow sim --from-run to {trace}.",
        steps=bounds.steps,
        pipeline=config,
        # replaced by each law's fit below
        generation=GenerationModel(median_s=1.0)
        if tokens is None
        else tokens.model(GenerationModel(median_s=1.0)),
        teachers=teachers,
        agents=agents,
        train_step_s=train_s,
        verifier=verifier,
        weight_sync=None,
        train_blocks_loop=blocks,
    )
    candidates = []
    labels = []
    walks = {False: walk, True: _unfrozen(walk, syncs)}
    fits: dict[tuple[str, bool], tuple[GenerationModel, EngineModel]] = {}
    for law in GENERATION_LAWS:
        for mode, weight_sync in syncing:
            unfreeze = mode == "interrupt" and law != "shared"
            if (law, unfreeze) not in fits:
                fits[law, unfreeze] = _generation(
                    walks[unfreeze],
                    generations,
                    config.shape.max_inflight_prompts,
                    sum(syncs.values()),
                    law,
                    tokens,
                )
            generation, engines = fits[law, unfreeze]
            labels.append(f"{law} generation, {mode} sync")
            candidate = attrs.evolve(
                fitted,
                description=f"Fitted by groupflow sim --from-run to {trace} ({labels[-1]}).",
                generation=generation,
                engines=engines,
                weight_sync=weight_sync,
            )
            refit = functools.partial(
                _generation,
                generations=generations,
                inflight=config.shape.max_inflight_prompts,
                sync_total=sum(syncs.values()),
                law=law,
                tokens=tokens,
            )
            candidates.append(_with_drain(candidate, walk, syncs, refit))
    steps = len(walk.steps)
    teacher_calls = [c for lane in range(bounds.teachers) for c in walk.calls.get(lane, [])]
    design = Design.PUMP if config.scoring is None else config.scoring.design
    observed = Observed(
        steps=steps,
        s_per_step=walk.wall / steps,
        calls_per_step=len(teacher_calls) / steps,
        rows_per_call=statistics.fmean(r for r, _ in teacher_calls) if teacher_calls else 0.0,
        teacher_s_per_step=sum(s for _, s in teacher_calls) / steps,
        generation_concurrency=walk.load_integral / walk.wall if walk.wall else 0.0,
        permit_s_per_step=0.0 if design is Design.PUMP else math.nan,
        sync_s_per_step=sync_s,
        terms=_terms(walk, sync_s, bounds.teachers),
    )
    scenario, errors = _choose(candidates, observed, config)
    kept = candidates.index(scenario)
    generation = scenario.generation
    if generation.tokens_sigma:
        notes.append(
            f"tokens: a group carried {generation.tokens:.0f} tokens (median; spread "
            f"{generation.tokens_sigma:.2f}), and {generation.token_share:.0%} of a rollout's "
            f"time grows with them"
        )
    elif generation.tokens:
        notes.append(
            f"tokens: a group carried {generation.tokens:.0f} tokens (all or nearly): no time "
            f"is read against them"
        )
    if scenario.engines.lockstep:
        notes.append(
            f"generation: the rollouts that started together ended together (their times "
            f"spread {generation.sigma:.3f} as sigma of the log, under {_LOCKSTEP:.0%} of all "
            f"the times' spread): they draw one time alone (lockstep)"
        )
    costs = {f"teacher {name}": teacher for name, teacher in teachers.items()}
    if verifier is not None:
        costs["verifier"] = verifier
    for name, teacher in costs.items():
        if teacher.per_token_s:
            notes.append(
                f"{name}: a call costs {teacher.per_token_s * 1e3:.3g} s per thousand tokens "
                f"of its rows, besides its rows' own cost"
            )
    sync = scenario.weight_sync
    if sync is not None and sync.drain != 1:
        notes.append(
            f"weight sync: the rollouts in flight when a sync waits for them go {sync.drain:.2f} "
            f"times slower meanwhile, to end as late after its start as in the run (drain)"
        )
    if sync is not None and (pooled := _pooled_syncs(walk, syncs, sync)):
        notes.append(pooled)
    if sync is not None and sync.idle_s is not None:
        notes.append(
            f"weight sync: a sync that found no rollout in flight took {sync.idle_s:.3f} s, one "
            f"that waited for some {sync.fixed_s:.3f} s after the last of them: the two are "
            f"fitted apart (idle_s)"
        )
    notes.append(
        f"kept {labels[kept]}, of (errors in seconds per step, rollouts "
        f"generating, teacher calls per step, sync seconds per step over "
        f"{min(bounds.steps, _CHOOSE_STEPS)} simulated steps): "
        + "; ".join(
            f"{label} " + " ".join(f"{e:+.1%}" for e in error)
            for label, error in zip(labels, errors, strict=True)
        )
    )
    return Calibration(scenario, observed, tuple(notes))


_CHOOSE_STEPS = 100
"""Steps each candidate is simulated for when the fit chooses between them."""


def variant_of(config: PipelineConfig) -> Variant:
    """The design the run used, as a simulator variant."""
    scoring = config.scoring
    if scoring is None:
        return Variant("run's design", Design.PUMP, Dispatch.DEMAND)
    return Variant(
        f"{scoring.design.value} ({scoring.dispatch.value})", scoring.design, scoring.dispatch
    )


_WEIGHTS = (2.0, 0.5, 1.0, 1.0)
"""How much each error counts when the fit chooses: seconds per step most (the figure a user
decides on), rollouts generating least (it only says where generation's time went)."""


def _choose(
    candidates: Sequence[Scenario], observed: Observed, config: PipelineConfig
) -> tuple[Scenario, list[tuple[float, float, float, float]]]:
    """The candidate whose simulation comes closest to the run: its seconds per step, its
    rollouts generating (where generation is off the critical path, it tells rollouts served in
    turn from rollouts side by side), its teacher calls per step (rollouts that end together,
    as a batching engine's do, meet the stage together: fewer, larger calls) and its sync's
    seconds (a sync that waits for rollouts takes as long as they do)."""
    errors = []
    for scenario in candidates:
        result = simulate(scenario, variant_of(config), steps=min(scenario.steps, _CHOOSE_STEPS))
        errors.append(
            (
                result.s_per_step / observed.s_per_step - 1,
                result.generation_concurrency / observed.generation_concurrency - 1
                if observed.generation_concurrency
                else 0.0,
                result.calls_per_step / observed.calls_per_step - 1
                if observed.calls_per_step
                else 0.0,
                result.sync_s_per_step / observed.sync_s_per_step - 1
                if observed.sync_s_per_step
                else 0.0,
            )
        )
    best = min(
        range(len(candidates)),
        key=lambda i: sum(w * abs(e) for w, e in zip(_WEIGHTS, errors[i], strict=True)),
    )
    return candidates[best], errors


COMPARED = (
    ("seconds per step", "s_per_step"),
    ("teacher calls per step", "calls_per_step"),
    ("rows per call", "rows_per_call"),
    ("teacher seconds per step", "teacher_s_per_step"),
    ("rollouts generating", "generation_concurrency"),
    ("permit-seconds held by scoring per step", "permit_s_per_step"),
    ("weight sync seconds per step", "sync_s_per_step"),
)


def compare(observed: Observed, simulated: SimResult) -> list[tuple[str, float, float, float]]:
    """(what, the run's, the simulation's, relative error) for each figure in `COMPARED`;
    the error is NaN where the run's figure is 0 or unknown."""
    out = []
    for label, attr in COMPARED:
        real = float(getattr(observed, attr))
        sim = float(getattr(simulated, attr))
        out.append((label, real, sim, _error(real, sim)))
    return out


def _error(real: float, sim: float) -> float:
    """The simulation's relative error; NaN where the run's figure is 0 or unknown."""
    return (sim - real) / real if real and math.isfinite(real) else math.nan


@attrs.frozen
class Compared:
    """One figure of `COMPARED`: the run's, the mean of the simulations' (one per seed), the
    mean's error, and each seed's error (one seed's draws move a figure by several percent)."""

    label: str
    run: float
    simulated: float
    error: float
    """NaN where the run's figure is 0 or unknown."""
    errors: tuple[float, ...]


def summarize(per_seed: Sequence[Sequence[tuple[str, float, float, float]]]) -> list[Compared]:
    """`compare`'s rows of each seed, figure by figure."""
    out = []
    for rows in zip(*per_seed, strict=True):
        label, real = rows[0][:2]
        sim = statistics.fmean(row[2] for row in rows)
        out.append(Compared(label, real, sim, _error(real, sim), tuple(row[3] for row in rows)))
    return out


def comparison_table(per_seed: Sequence[Sequence[tuple[str, float, float, float]]]) -> str:
    """`compare`'s rows, of one seed or the mean over several: then each error's range over
    the seeds too."""
    several = len(per_seed) > 1
    lines = [f"{'':<42}{'run':>12}{'simulated':>12}{'error':>9}"]
    if several:
        lines[0] += f"  {'range over the seeds':>22}"
    for row in summarize(per_seed):
        line = f"{row.label:<42}{row.run:>12.4g}{row.simulated:>12.4g}{_percent(row.error):>9}"
        if several:
            span = f"{_percent(min(row.errors))} to {_percent(max(row.errors))}"
            line += f"  {span if math.isfinite(row.error) else '-':>22}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _percent(error: float) -> str:
    if not math.isfinite(error):
        return "-"
    return f"{0.0 if abs(error) < 0.0005 else error:+.1%}"  # never "-0.0%"


def mean_terms(terms: Sequence[Terms]) -> Terms:
    """Each term's mean over several simulations (seeds) of one scenario."""
    return Terms(
        *(statistics.fmean(getattr(t, f.name) for t in terms) for f in attrs.fields(Terms))
    )


_TERMS = (
    ("train", "train_s"),
    ("weight sync", "sync_s"),
    ("waiting for the step's groups", "waiting_s"),
)
_CAUSES = (("rollout seconds (mean)", "rollout_s"), ("teacher seconds per call (mean)", "call_s"))


def attribution_table(run: Terms, simulated: Terms) -> str:
    """Where a step's seconds go in the run and in its simulation: the three parts add up to
    seconds per step, so their differences split its error between the model's terms; the
    waiting's causes (rollouts, teacher calls) are compared as ratios."""
    lines = [
        f"{'where a step goes (seconds per step)':<42}{'run':>12}{'simulated':>12}{'error':>9}"
    ]
    for label, attr in _TERMS:
        real, sim = getattr(run, attr), getattr(simulated, attr)
        lines.append(f"{label:<42}{real:>12.4g}{sim:>12.4g}{sim - real:>+8.3f}s")
    for label, attr in _CAUSES:
        real, sim = getattr(run, attr), getattr(simulated, attr)
        error = _percent(sim / real - 1) if real else "-"
        lines.append(f"{'  ' + label:<42}{real:>12.4g}{sim:>12.4g}{error:>9}")
    parts = sorted(
        ((getattr(simulated, a) - getattr(run, a), label) for label, a in _TERMS),
        key=lambda p: -abs(p[0]),
    )
    lines.append(
        "the error in seconds per step is "
        + ", ".join(f"{label} {delta:+.3f} s" for delta, label in parts)
    )
    return "\n".join(lines) + "\n"
