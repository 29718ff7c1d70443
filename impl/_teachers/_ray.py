"""`RayTeacherGroup`: a teacher run as a Ray worker group, one actor per DP rank.

Each actor builds its own teacher (a `TorchTeacher`, an `HFTeacher`, any `Teacher`) from a
function the group is given, on the device Ray gives it (a GPU per actor when the cluster has
enough). The group is a `Teacher`: `score_shards` sends shard i to actor i and gathers, so
`score_teacher_batch`, the teacher stage and the pipeline do not change.

Every call is bounded. The group waits for its actors with `ray.wait` in short slices, so a
call ends when all of them answered, when one failed, when `call_timeout_s` passed, or, in a
worker thread trio started (the stage's `ThreadedScorer`), as soon as the trio side cancelled
it (the stage's own `call_timeout_s`, a shutdown: trio's cancellation then goes on through
the thread). An actor that dies mid-call or does not
answer in time is killed and, by `on_actor_loss`, either replaced by a fresh one (the call
fails with an error the stage's failure policy retries: `TransientError` for a death,
`ScoringTimeout` for a hang) or the teacher is reported lost (`ScorerLost`: the run fails).
Ray's own actor restarts are off: the group decides, and counts, every restart.

Needs Ray (`pip install 'groupflow[ray]'`); see `ray_session` for starting or joining one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl._core import (
    choice,
    import_ray,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from groupflow.impl._pipeline import ThreadedScorer
from groupflow.impl._teachers._batch import TEACHER_INPUTS, score_request
from groupflow.impl.contract import ScoreRequest, Teacher, TokenRow
from groupflow.model.enums import ValueEnum
from groupflow.model.errors import (
    ArgumentError,
    CallOrderError,
    ConfigError,
    ScorerLost,
    ScoringTimeout,
    TeacherOutputError,
    TransientError,
)

log = logging.getLogger("groupflow.teacher.ray")

POLL_S = 0.05
"""How often a waiting call looks at its deadline and at trio's cancellation."""


class ActorLoss(ValueEnum):
    """What a `RayTeacherGroup` does when an actor dies or hangs mid-call."""

    RESTART = "restart"
    """Kill it and start a fresh one on the same rank; the call fails, retryable."""
    LOST = "lost"
    """Report the teacher lost (`ScorerLost`): this call and every later one fail."""


def _actor_loss(value: ActorLoss | str) -> ActorLoss:
    return choice(ActorLoss, value, config="RayTeacherConfig", field="on_actor_loss")


def _non_negative_number(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(
            f"RayTeacherConfig.{attribute.name} must be a number >= 0, got {value!r}",
            field=attribute.name,
            config="RayTeacherConfig",
        )


def _gpus(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _non_negative_number(instance, attribute, value)


@attrs.frozen
class RayTeacherConfig:
    """A Ray teacher worker group: its width, its resources, its time limits, its policy."""

    dp_size: int = attrs.field(validator=positive_int)
    """Actors, one per DP rank."""
    name: str = "teacher"
    """How errors and logs name the teacher."""
    num_cpus_per_actor: float = attrs.field(default=1.0, validator=_non_negative_number)
    num_gpus_per_actor: float | None = attrs.field(default=None, validator=_gpus)
    """None: one GPU per actor when the cluster has at least `dp_size` GPUs, else none."""
    call_timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    """A call whose actors have not all answered by then fails (`ScoringTimeout`) and the
    actors still running it are killed (a hang). Keep it at most the stage's
    `call_timeout_s`: the stage cancels its call then anyway."""
    start_timeout_s: float = attrs.field(default=300.0, validator=positive_seconds)
    """How long an actor may take to start (building its teacher) before it counts as lost."""
    on_actor_loss: ActorLoss = attrs.field(default=ActorLoss.RESTART, converter=_actor_loss)
    max_restarts: int = attrs.field(default=3, validator=non_negative_int)
    """Restarts the group makes over its life, all ranks together; one more loss after that
    reports the teacher lost."""
    spread: bool = False
    """Place the actors on as many of the cluster's nodes as can take one (Ray's `SPREAD`),
    so that a node's loss takes one rank, not the group; by default Ray packs them."""


class _TeacherWorker:
    """What runs in each actor: the teacher its factory builds, scoring one shard per call."""

    def __init__(self, make_teacher: Callable[[], Teacher], rank: int) -> None:
        self._teacher = make_teacher()
        self._rank = rank
        self._calls = 0
        self._rows = 0

    def describe(self) -> dict[str, Any]:
        ray = import_ray()
        context = ray.get_runtime_context()
        return {
            "rank": self._rank,
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "calls": self._calls,
            "rows": self._rows,
        }

    def score(self, rows: list[TokenRow]) -> list[list[float]]:
        shards = self._teacher.score_shards([rows])
        if len(shards) != 1:
            raise TeacherOutputError(
                f"the teacher of DP rank {self._rank} returned {len(shards)} shards for one"
            )
        self._calls += 1
        self._rows += len(rows)
        return [[float(v) for v in row] for row in shards[0]]


@functools.cache
def _actor_class() -> Any:
    return import_ray().remote(_TeacherWorker)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(error: BaseException) -> str:
    """What a Ray error says, short: its first line and, when it has more, its last (where
    Ray puts the reason an actor died, or the error its constructor raised)."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _cancelled_by_trio() -> BaseException | None:
    """trio's `Cancelled` when the trio task that started this worker thread was cancelled;
    None while it was not, and in any other thread."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled as cancelled:
        return cancelled
    except RuntimeError:  # not a thread trio started: nothing to ask
        return None
    return None


class RayTeacherGroup:
    """A `Teacher` whose DP ranks are Ray actors (see the module). Start it with `start`,
    close it with `close` (or use it as a context manager); it is thread-safe."""

    reads = TEACHER_INPUTS

    def __init__(
        self, make_teacher: Callable[[], Teacher], config: RayTeacherConfig, *, num_gpus: float
    ) -> None:
        """Use `start`."""
        self._make_teacher = make_teacher
        self.config = config
        self._num_gpus = num_gpus
        self._lock = threading.Lock()
        self._actors: list[Any] = []
        self._starting: dict[int, Any] = {}
        """Ranks whose actor was (re)started and has not yet said it is ready: their
        `describe` call."""
        self._restarts = 0
        self._lost: str | None = None
        self._closed = False
        self._closing = threading.Event()
        """Set by `close`: a call in flight ends at its next poll, so `close` never waits
        out a hung call."""

    @classmethod
    def start(
        cls, make_teacher: Callable[[], Teacher], config: RayTeacherConfig
    ) -> RayTeacherGroup:
        """Start `config.dp_size` actors, each calling `make_teacher()` (it must pickle: a
        function of an importable module, or a `functools.partial` of one), and wait until
        every one is ready, at most `start_timeout_s`. Ray must be running (`ray_session`).
        Blocking: from trio, call it in a worker thread."""
        ray = import_ray()
        if not ray.is_initialized():
            raise CallOrderError(
                "RayTeacherGroup.start needs a running Ray: open a ray_session first"
            )
        gpus = config.num_gpus_per_actor
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= config.dp_size else 0.0
        group = cls(make_teacher, config, num_gpus=gpus)
        try:
            group._actors = [group._spawn(rank) for rank in range(config.dp_size)]
            group._starting = {r: a.describe.remote() for r, a in enumerate(group._actors)}
            group._await_started()
        except BaseException:
            group.close()
            raise
        return group

    # -- the Teacher protocol ------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        """Shard i to actor i, all at once; blocks until every actor answered (see the
        module for how a call can fail)."""
        if len(shards) != self.dp_size:
            raise ArgumentError(
                f"teacher {self.config.name!r}: {len(shards)} shards for dp_size={self.dp_size}"
            )
        with self._lock:
            self._check_usable()
            if self._starting:
                self._await_started()
            refs = [self._dispatch(rank, list(shard)) for rank, shard in enumerate(shards) if shard]
            ranks = [rank for rank, shard in enumerate(shards) if shard]
            answers = self._gather(dict(zip(refs, ranks, strict=True)))
        out: list[list[Sequence[float]]] = [list(answers.get(r, [])) for r in range(self.dp_size)]
        return out

    async def score(self, request: ScoreRequest) -> None:
        """The `Scorer` the teacher stage calls (like `TorchTeacher.score`): the batch is
        scored by `score_teacher_batch` in a worker thread."""
        await ThreadedScorer(functools.partial(score_request, self)).score(request)

    # -- operations ----------------------------------------------------------------------

    @property
    def restarts(self) -> int:
        """Actors restarted so far."""
        return self._restarts

    @property
    def lost(self) -> str | None:
        """Why the teacher is lost, or None while it is not."""
        return self._lost

    def actor(self, rank: int) -> Any:
        """The Ray actor handle of DP rank `rank` (to inspect it, or to kill it in a drill)."""
        return self._actors[rank]

    def describe(self, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Per rank: its actor's pid, node, GPUs, and the calls and rows it scored."""
        ray = import_ray()
        with self._lock:
            self._check_usable()
            refs = [actor.describe.remote() for actor in self._actors]
        out: list[dict[str, Any]] = ray.get(refs, timeout=timeout_s)
        return out

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Kill every actor and wait until Ray reports each dead (at most `timeout_s`), so
        their CPUs and GPUs are free when this returns; idempotent. A call in flight fails
        (`CallOrderError`). Blocking."""
        ray = import_ray()
        self._closing.set()
        with self._lock:
            self._closed = True
            actors, self._actors = self._actors, []
            self._starting = {}
        for actor in actors:
            _kill(ray, actor)
        deadline = time.monotonic() + timeout_s
        alive = list(actors)
        while alive and time.monotonic() < deadline:
            # a kill takes effect a moment later: an actor still answering is not gone yet
            probes = {actor.describe.remote(): actor for actor in alive}
            ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=1.0)
            alive = [
                actor for ref, actor in probes.items() if ref not in ready or _answers(ray, ref)
            ]
            if alive:
                time.sleep(POLL_S)
        if alive:
            log.warning(
                "teacher %r: %d actors still answered %g s after they were killed",
                self.config.name,
                len(alive),
                timeout_s,
            )

    def __enter__(self) -> RayTeacherGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise CallOrderError(f"teacher {self.config.name!r}: the worker group is closed")
        if self._lost is not None:
            raise ScorerLost(f"teacher {self.config.name!r} is lost: {self._lost}")

    def _spawn(self, rank: int) -> Any:
        options: dict[str, Any] = {
            "num_cpus": self.config.num_cpus_per_actor,
            "num_gpus": self._num_gpus,
            "max_restarts": 0,  # the group restarts actors itself, and counts them
            "max_task_retries": 0,
        }
        if self.config.spread:
            options["scheduling_strategy"] = "SPREAD"
        return _actor_class().options(**options).remote(self._make_teacher, rank)

    def _dispatch(self, rank: int, rows: list[TokenRow]) -> Any:
        return self._actors[rank].score.remote(rows)

    def _await_started(self) -> None:
        """Wait for the actors being (re)started; one that fails or is not ready in time is
        lost (restarting it again would most likely fail the same way)."""
        ray = import_ray()
        pending = {ref: rank for rank, ref in self._starting.items()}
        deadline = time.monotonic() + self.config.start_timeout_s
        while pending:
            if self._closing.is_set():
                raise CallOrderError(
                    f"teacher {self.config.name!r}: the worker group was closed while it started"
                )
            cancelled = _cancelled_by_trio()
            if cancelled is not None:
                raise cancelled  # still starting: the next call waits for them again
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending.values())
                for rank in ranks:
                    _kill(ray, self._actors[rank])
                self._lost = (
                    f"the actors of DP ranks {ranks} were not started within "
                    f"start_timeout_s={self.config.start_timeout_s:g}"
                )
                raise ScorerLost(f"teacher {self.config.name!r} is lost: {self._lost}")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(POLL_S, remaining))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as error:
                    _kill(ray, self._actors[rank])
                    self._lost = (
                        f"the actor of DP rank {rank} failed to start: {_first_line(error)}"
                    )
                    raise ScorerLost(
                        f"teacher {self.config.name!r} is lost: {self._lost}"
                    ) from error
                self._starting.pop(rank, None)

    def _gather(self, pending: dict[Any, int]) -> dict[int, list[list[float]]]:
        """Every rank's answer. A rank that fails (its actor died, its teacher raised) does not
        end the wait: the other ranks' calls are waited for too (within the same limits), so
        no work of this call outlives it; then the first failure is raised."""
        ray = import_ray()
        answers: dict[int, list[list[float]]] = {}
        failure: tuple[BaseException, BaseException | None] | None = None
        deadline = time.monotonic() + self.config.call_timeout_s
        while pending:
            if self._closing.is_set():
                raise CallOrderError(
                    f"teacher {self.config.name!r}: the worker group was closed during the call"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._hung(
                    sorted(pending.values()),
                    f"did not answer within call_timeout_s={self.config.call_timeout_s:g}",
                )
            cancelled = _cancelled_by_trio()
            if cancelled is not None:
                # the stage gave up on the call (its call limit, a shutdown): the actors still
                # running it would make the next call queue behind it, so they go as if hung,
                # and the cancellation goes on to trio (through `ThreadedScorer`)
                ranks = sorted(pending.values())
                self._replace_or_lose(
                    ranks,
                    f"the actors of DP ranks {ranks} had not answered when trio cancelled the "
                    f"call; killed",
                )
                raise cancelled
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(POLL_S, remaining))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    answers[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    try:
                        self._died(rank, error)
                    except Exception as reported:
                        failure = failure or (reported, reported.__cause__)
                except ray.exceptions.RayTaskError as error:
                    # the teacher raised inside the actor: its own error, as if local
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    failure = failure or (cause, error)
        if failure is not None:
            raise failure[0] from failure[1]
        return answers

    def _replace_or_lose(self, ranks: list[int], what: str) -> str:
        """Kill the actors of `ranks`; restart them if the policy and the budget allow, else
        mark the teacher lost. Returns what was done, for the error's message."""
        ray = import_ray()
        for rank in ranks:
            _kill(ray, self._actors[rank])
        config = self.config
        if config.on_actor_loss is ActorLoss.LOST:
            self._lost = f"{what}, and on_actor_loss='lost'"
            return self._lost
        if self._restarts + len(ranks) > config.max_restarts:
            self._lost = (
                f"{what}, and max_restarts={config.max_restarts} would be exceeded "
                f"({self._restarts} restarts so far)"
            )
            return self._lost
        for rank in ranks:
            self._actors[rank] = self._spawn(rank)
            self._starting[rank] = self._actors[rank].describe.remote()
        self._restarts += len(ranks)
        done = f"{what}; restarted (restart {self._restarts} of max_restarts={config.max_restarts})"
        log.warning("teacher %r: %s", config.name, done)
        return done

    def _died(self, rank: int, error: BaseException) -> None:
        what = f"the actor of DP rank {rank} died during the call ({_first_line(error)})"
        done = self._replace_or_lose([rank], what)
        if self._lost is not None:
            raise ScorerLost(f"teacher {self.config.name!r} is lost: {done}") from error
        raise TransientError(f"teacher {self.config.name!r}: {done}") from error

    def _hung(self, ranks: list[int], why: str) -> None:
        done = self._replace_or_lose(ranks, f"the actors of DP ranks {ranks} {why}; killed")
        timeout = ScoringTimeout(f"teacher {self.config.name!r}: {done}")
        if self._lost is not None:
            raise ScorerLost(f"teacher {self.config.name!r} is lost: {done}") from timeout
        raise timeout


def _answers(ray: Any, ref: Any) -> bool:
    """Whether a finished call on an actor came back (the actor was alive for it)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return False
    return True


def _kill(ray: Any, actor: Any) -> None:
    """Kill an actor, which may be dead already."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as error:  # already gone: nothing to kill
        log.debug("killing actor %r: %r", actor, error)


__all__ = ["ActorLoss", "RayTeacherConfig", "RayTeacherGroup"]
