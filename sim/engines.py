"""The simulated inference fleet behind a scenario's rollouts: engines with continuous batching,
a weight sync after every train step, and a fresh draw for every attempt at a prompt.

- **Engine batching.** A rollout's sequences (`num_generations` of them) run on one engine, the
  least loaded when it starts. Each sequence needs its drawn base time of work; it progresses at
  `1 / factor` of real speed, `factor` the slowdown of the `n` sequences sharing its engine
  (`EngineModel.slowdown`, a curve through a few points) plus `per_token` for each token its
  engine serves at once. The rate is recomputed whenever an engine's load changes, so freeing
  permits early buys less when the engines are already busy.
- **Weight sync.** After each train step the learner's weights reach the engines
  (`WeightSyncModel`): `fixed_s + per_param_s * params` seconds, during which no rollout
  starts. Under `wait` it begins once the in-flight rollouts have finished (on a batching
  engine they go `drain` times slower meanwhile); under `interrupt` the in-flight rollouts
  pause for it and then go on with the new weights.
- **Attempts.** A prompt issued again (after a failed rollout, a shutdown or a crash) draws its
  generation time and whether it fails afresh, keyed by its attempt number.

Every draw is keyed by the seed and what it is for, so the same scenario and seed replay
exactly. `sync_weights` is what the pipeline's train pump awaits, so its time is the step's.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl.contract import GenerateRequest
from groupflow.impl.testing import Span, Trace
from groupflow.model.policy import SyncMode
from groupflow.sim.spread import as_spread, draw, rng

_EPSILON = 1e-9
"""Work left below this many seconds is done (float error from rate changes)."""


def _curve(value: Any) -> tuple[tuple[float, float], ...]:
    try:
        points = tuple((float(n), float(f)) for n, f in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"slowdown must be a list of [sequences, factor] points, got {value!r}"
        ) from None
    if not points:
        raise ValueError("slowdown needs at least one [sequences, factor] point")
    for (n0, _), (n1, _) in zip(points, points[1:], strict=False):
        if not n1 > n0:
            raise ValueError(f"slowdown points must rise in sequences, got {value!r}")
    for n, f in points:
        if not (n >= 1 and math.isfinite(f) and f >= 1):
            raise ValueError(
                f"slowdown point [{n:g}, {f:g}]: sequences must be >= 1 and the factor a "
                f"finite number >= 1 (1: as fast as alone)"
            )
    return points


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen
class EngineModel:
    """How many engines serve generation, and how a sequence slows as its engine fills.

    `slowdown` lists `[sequences, factor]` points: with that many sequences on one engine, each
    takes `factor` times its time alone. Between points the factor is interpolated linearly,
    beyond the last it stays at the last (a real engine caps its batch; the scenario's
    `max_inflight_prompts` does too)."""

    engines: int = attrs.field(default=1)
    slowdown: tuple[tuple[float, float], ...] = attrs.field(default=((1.0, 1.0),), converter=_curve)
    batching: bool = attrs.field(default=True)
    """False: an engine serves one rollout at a time, in arrival order (a generator behind a
    lock, as the trainer's student is), and `slowdown` is not used."""
    per_token: float = attrs.field(default=0.0, validator=_non_negative)
    """How much more each sequence's time grows, as a share of its time alone, per token its
    engine serves at once (its groups' tokens, `GenerationModel.tokens`): attention reads
    every token in flight, so long sequences slow their neighbours beyond their number. 0:
    only the sequences' number matters."""
    lockstep: bool = attrs.field(default=False)
    """Rollouts that start at one instant on an engine share one drawn time alone (the first
    one's), so they end together: a served engine decodes the answers it takes at once in the
    same forward passes, and answers of one length end in the same one. False: each rollout
    draws its own."""

    def __attrs_post_init__(self) -> None:
        if self.per_token and not self.batching:
            raise ValueError(
                f"per_token = {self.per_token!r} slows the sequences a batching engine serves at "
                f"once, and batching = false serves one at a time: drop one of them"
            )
        if self.lockstep and not self.batching:
            raise ValueError(
                "lockstep = true ends together the rollouts a batching engine takes at once, "
                "and batching = false serves one at a time: drop one of them"
            )

    @batching.validator
    @lockstep.validator
    def _check_flag(self, attribute: attrs.Attribute[bool], value: object) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{attribute.name} must be true or false, got {value!r}")

    @engines.validator
    def _check_engines(self, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"engines must be an int >= 1, got {value!r}")

    def factor(self, sequences: float, tokens: float = 0) -> float:
        """Each sequence's time over its time alone, with `sequences` on its engine carrying
        `tokens` in all."""
        return self._curve(sequences) + self.per_token * tokens

    def _curve(self, sequences: float) -> float:
        points = self.slowdown
        if sequences <= points[0][0]:
            return points[0][1]
        if sequences >= points[-1][0]:
            return points[-1][1]
        i = bisect.bisect_right([n for n, _ in points], sequences)
        (n0, f0), (n1, f1) = points[i - 1], points[i]
        return f0 + (f1 - f0) * (sequences - n0) / (n1 - n0)


SYNC_MODES = tuple(mode.value for mode in SyncMode)


def _as_idle_spread(value: Any) -> tuple[float, ...]:
    return as_spread(value, "idle_spread")


@attrs.frozen
class WeightSyncModel:
    """Seconds to push new weights to the engines after a train step: `fixed_s + per_param_s *
    params`; `mode` says whether the push waits for in-flight generation (`wait`) or pauses
    it (`interrupt`)."""

    fixed_s: float = attrs.field(default=0.0, validator=_non_negative)
    per_param_s: float = attrs.field(default=0.0, validator=_non_negative)
    params: float = attrs.field(default=0.0, validator=_non_negative)
    mode: str = attrs.field(default="wait")
    spread: tuple[float, ...] = attrs.field(default=(), converter=as_spread)
    """Multipliers of `seconds`, one drawn per sync with equal shares (`groupflow.sim.spread`):
    a fit keeps the run's own syncs' spread here."""
    idle_s: float | None = attrs.field(default=None)
    """Under `wait`: the mean seconds of a sync that finds no rollout in flight, where they
    differ from those of one that waited for some (a served engine resumes in a fraction of
    the time after a pause with nothing to drain); None: the same."""
    idle_spread: tuple[float, ...] = attrs.field(default=(), converter=_as_idle_spread)
    """Multipliers of `idle_s`, as `spread` is of `seconds`."""
    drain: float = attrs.field(default=1.0)
    """Under `wait`: how many times slower the rollouts in flight go on a batching engine
    while the sync waits for them (on a shared machine the trainer's side of the sync competes
    with them); 1: as fast as ever."""

    def __attrs_post_init__(self) -> None:
        if self.mode != "wait" and (self.idle_s is not None or self.idle_spread or self.drain != 1):
            raise ValueError(
                f'idle_s, idle_spread and drain apply to mode = "wait" only (a sync that does '
                f"not wait has no rollout in flight to wait for), got mode = {self.mode!r}: "
                f'drop them or set mode = "wait"'
            )

    @drain.validator
    def _check_drain(self, attribute: attrs.Attribute[float], value: float) -> None:
        _non_negative(self, attribute, value)
        if value < 1:
            raise ValueError(
                f"drain must be >= 1 (how many times slower; 1: as fast as ever), got {value!r}"
            )

    @idle_s.validator
    def _check_idle(self, attribute: attrs.Attribute[float | None], value: object) -> None:
        if value is not None:
            _non_negative(self, attribute, value)

    @mode.validator
    def _check_mode(self, attribute: attrs.Attribute[str], value: object) -> None:
        if value not in SYNC_MODES:
            raise ValueError(f"mode must be one of {list(SYNC_MODES)}, got {value!r}")

    @property
    def seconds(self) -> float:
        """The mean seconds of a sync."""
        return self.fixed_s + self.per_param_s * self.params

    def duration(self, seed: int, version: int, *, idle: bool = False) -> float:
        """The seconds of the sync that pushes weights `version`; `idle`: it found no rollout
        in flight."""
        if idle and self.idle_s is not None:
            return self.idle_s * draw(self.idle_spread, rng(seed, "sync", version))
        return self.seconds * draw(self.spread, rng(seed, "sync", version))


@attrs.define(eq=False)
class _Waiter:
    """One rollout on a batching engine: done once the engine's `work` reaches `target`."""

    target: float
    wake: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Engine:
    index: int
    sequences: int = 0
    tokens: int = 0
    """The tokens of the groups it serves (`EngineModel.per_token`)."""
    changed: trio.Event = attrs.field(factory=trio.Event)
    work: float = 0.0
    """With batching: the work one sequence on this engine has done since it started (all its
    sequences progress at one rate), as of `at`."""
    at: float = 0.0
    waiting: list[tuple[float, int, _Waiter]] = attrs.field(factory=list)
    """With batching: its rollouts by the work they are done at (a heap); only the first needs
    a timer, so a change of rate wakes one task, not every rollout on the engine."""
    serial: int = 0
    free_at: float = -math.inf
    """Without batching: when the engine is done with every rollout it has taken."""
    tickets: list[list[float]] = attrs.field(factory=list)
    """Without batching: the [start, end] of each rollout it has taken and not finished."""
    started: tuple[float, float] = (-math.inf, 0.0)
    """With lockstep: when its latest rollout started, and that rollout's time alone."""

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@functools.lru_cache(maxsize=4096)
def _token_ids(length: int) -> tuple[int, ...]:
    """`length` token ids, one tuple per length: a simulated row's tokens are counted, never
    read."""
    return (0,) * length


@attrs.define(eq=False)
class EngineGenerator:
    """The pipeline's `Generator` in a simulation (see the module docstring).

    `latency(ordinal, attempt)` draws a rollout's base time (each of its sequences', alone on
    an engine); `fails(ordinal, attempt)` whether it fails at its end; `tokens(ordinal,
    attempt)`, where given, the group's tokens, spread over its rows' `input_ids` (without it,
    each row has two)."""

    latency: Callable[[int, int], float]
    fails: Callable[[int, int], bool] = lambda ordinal, attempt: False
    tokens: Callable[[int, int], int] | None = None
    group_tokens: dict[int, int] = attrs.field(factory=dict, init=False)
    """Prompt -> the tokens of its latest rollout's group (what a teacher call reads)."""
    model: EngineModel = attrs.field(factory=EngineModel)
    sync: WeightSyncModel | None = None
    trace: Trace | None = None
    seed: int = 0
    """Keys the syncs' draws (`WeightSyncModel.spread`)."""
    engines: list[_Engine] = attrs.field(init=False)
    attempts: collections.Counter[int] = attrs.field(factory=collections.Counter)
    running: int = 0
    """Rollouts generating now."""
    most_running: int = 0
    busy_seconds: float = 0.0
    """Rollout-seconds in flight, from the request to its end, a wait for a weight sync
    included (as a run's trace counts them): the pipeline's concurrency, over the elapsed
    time."""
    sync_seconds: float = 0.0
    """Seconds spent in weight syncs."""
    synced: list[int] = attrs.field(factory=list)
    load: list[tuple[float, int, int]] = attrs.field(factory=list)
    """(time, engine, sequences on it) at every change: the timeline's per-engine concurrency."""
    fields: frozenset[str] = frozenset({"input_ids", "generation_logprobs"})
    _syncing: bool = False
    _paused: bool = False
    _draining: bool = False
    """A waiting sync is draining the rollouts in flight (`WeightSyncModel.drain`)."""
    _sync_done: trio.Event = attrs.field(factory=trio.Event)
    _idle: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.engines = [_Engine(i) for i in range(self.model.engines)]
        self._sync_done.set()
        self._idle.set()

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        ordinal = request.ordinal
        attempt = self.attempts[ordinal]
        self.attempts[ordinal] += 1
        arrived = trio.current_time()
        while self._syncing:  # no rollout starts while new weights are loading
            await self._sync_done.wait()
        engine = min(self.engines, key=lambda e: (e.sequences, e.index))
        size = max(1, request.num_generations)
        seconds = self._alone(engine, ordinal, attempt)
        tokens = 0 if self.tokens is None else self.tokens(ordinal, attempt)
        waiter = self._join(engine, size, tokens, seconds)
        start = trio.current_time()
        ok = cancelled = False
        try:
            if waiter is not None:
                await self._work(engine, waiter)
            else:
                await self._in_turn(engine, seconds)
            if self.fails(ordinal, attempt):
                raise RuntimeError(f"generation of prompt {ordinal} (attempt {attempt}) failed")
            ok = True
            return self._rows(ordinal, tokens, request.num_generations)
        except trio.Cancelled:
            cancelled = True
            raise
        finally:
            self._leave(engine, size, tokens, waiter)
            end = trio.current_time()
            self.busy_seconds += end - arrived
            if self.trace is not None:
                detail = f"engine {engine.index}" + (f", attempt {attempt}" if attempt else "")
                detail += ", cancelled" if cancelled else ""
                self.trace.add(Span("generate", str(ordinal), start, end, detail, ok=ok))

    def _alone(self, engine: _Engine, ordinal: int, attempt: int) -> float:
        """The rollout's time alone: its own draw, or with lockstep the one of the rollout
        that started on `engine` at this instant before it."""
        seconds = self.latency(ordinal, attempt)
        if not self.model.lockstep:
            return seconds
        now = trio.current_time()
        if engine.started[0] == now:
            return engine.started[1]
        engine.started = (now, seconds)
        return seconds

    def _rows(self, ordinal: int, tokens: int, count: int) -> list[dict[str, Any]]:
        """The group's rows: its tokens spread over their `input_ids` (rows of one length
        share one tuple, so memory grows with the lengths met, not the rows)."""
        if self.tokens is None:
            return [
                {"input_ids": [ordinal, i], "generation_logprobs": [-1.0]} for i in range(count)
            ]
        self.group_tokens[ordinal] = tokens
        share, extra = divmod(tokens, count)
        return [
            {"input_ids": _token_ids(share + (i < extra)), "generation_logprobs": [-1.0]}
            for i in range(count)
        ]

    async def _in_turn(self, engine: _Engine, seconds: float) -> None:
        """Without batching: served after every rollout the engine took before, for `seconds`.
        The times are worked out when the rollout arrives (and moved by a pausing sync), not
        handed over from task to task, so a learner that blocks the event loop (a jump of the
        virtual clock) does not stop the engine meanwhile, as it does not stop a thread."""
        start = max(trio.current_time(), engine.free_at)
        ticket = [start, start + seconds]
        engine.free_at = ticket[1]
        engine.tickets.append(ticket)
        try:
            while trio.current_time() < ticket[1] - _EPSILON:
                changed = engine.changed
                with trio.move_on_at(ticket[1]):
                    await changed.wait()
        finally:
            engine.tickets.remove(ticket)

    def _pause_turns(self, seconds: float) -> None:
        """A pausing sync of `seconds` from now: every rollout an engine has taken and not
        finished ends that much later, and so does the engine."""
        now = trio.current_time()
        for engine in self.engines:
            for ticket in engine.tickets:
                if ticket[1] > now:
                    ticket[0] = max(ticket[0], now) + seconds if ticket[0] > now else ticket[0]
                    ticket[1] += seconds
            if engine.free_at > now:
                engine.free_at += seconds

    async def _work(self, engine: _Engine, waiter: _Waiter) -> None:
        """Until the engine has done `waiter.target` of work per sequence. Only the rollout
        due first keeps a timer (when it is due at the engine's rate now); the others wait
        to become first. A pausing weight sync stops the engine meanwhile."""
        while True:
            self._advance(engine)
            first = engine.waiting[0][2] is waiter
            if first and engine.work >= waiter.target - _EPSILON:
                return
            deadline = math.inf
            if first and not self._paused:
                deadline = engine.at + (waiter.target - engine.work) * self._factor(engine)
            waiter.wake = trio.Event()
            with trio.move_on_at(deadline):
                await waiter.wake.wait()

    def _advance(self, engine: _Engine) -> None:
        """Bring the engine's work up to now, at the rate of its load since the last change."""
        now = trio.current_time()
        if engine.sequences and not self._paused:
            engine.work += (now - engine.at) / self._factor(engine)
        engine.at = now

    def _factor(self, engine: _Engine) -> float:
        """A sequence's time on `engine` now over its time alone."""
        factor = self.model.factor(engine.sequences, engine.tokens)
        if self._draining and self.sync is not None:
            factor *= self.sync.drain
        return factor

    def _drain(self, draining: bool) -> None:
        """Start or end a waiting sync's drain: the engines' rates change."""
        for engine in self.engines:
            self._advance(engine)
        self._draining = draining
        for engine in self.engines:
            self._wake_first(engine)

    @staticmethod
    def _wake_first(engine: _Engine) -> None:
        if engine.waiting:
            engine.waiting[0][2].wake.set()

    def _join(self, engine: _Engine, size: int, tokens: int, seconds: float) -> _Waiter | None:
        """Take a rollout of `size` sequences, `tokens` tokens and `seconds` of work alone on
        `engine`; with batching, the waiter that says when it is done."""
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        waiter = None
        if self.model.batching:
            self._advance(engine)
            waiter = _Waiter(engine.work + seconds)
            engine.serial += 1
            heapq.heappush(engine.waiting, (waiter.target, engine.serial, waiter))
        engine.sequences += size
        engine.tokens += tokens
        self.load.append((trio.current_time(), engine.index, engine.sequences))
        self._wake_first(engine)  # the rate changed: the first rollout's time moves
        return waiter

    def _leave(self, engine: _Engine, size: int, tokens: int, waiter: _Waiter | None) -> None:
        self.running -= 1
        if waiter is not None:
            self._advance(engine)
            if engine.waiting and engine.waiting[0][2] is waiter:
                heapq.heappop(engine.waiting)
            else:  # cancelled before its time
                engine.waiting = [item for item in engine.waiting if item[2] is not waiter]
                heapq.heapify(engine.waiting)
        engine.sequences -= size
        engine.tokens -= tokens
        self.load.append((trio.current_time(), engine.index, engine.sequences))
        self._wake_first(engine)
        if self.running == 0:
            self._idle.set()

    async def sync_weights(self, version: int) -> None:
        """Push weights `version` to the engines, as the scenario's `[weight_sync]` says (free
        without one)."""
        self.synced.append(version)
        sync = self.sync
        if sync is None:
            return
        seconds = sync.duration(self.seed, version, idle=self.running == 0)
        self._syncing = True
        self._sync_done = trio.Event()
        start = began = trio.current_time()
        try:
            if sync.mode == "wait":
                slowed = sync.drain != 1 and self.model.batching and self.running > 0
                if slowed:
                    self._drain(True)
                try:
                    await self._idle.wait()
                finally:
                    if slowed:
                        self._drain(False)
            else:
                for engine in self.engines:
                    self._advance(engine)
                self._paused = True
                if not self.model.batching:
                    self._pause_turns(seconds)
                for engine in self.engines:
                    engine.notify()  # running rollouts see the pause at once
                    self._wake_first(engine)
            began = trio.current_time()
            await trio.sleep(seconds)
        finally:
            for engine in self.engines:
                self._advance(engine)  # paused: no work since the pause
            self._syncing = self._paused = False
            self._sync_done.set()
            for engine in self.engines:
                engine.notify()
                self._wake_first(engine)
            end = trio.current_time()
            self.sync_seconds += end - start
            if self.trace is not None:
                detail = f"version {version}, waited {began - start:.3f} s for generation"
                self.trace.add(Span("sync", "weights", start, end, detail))
