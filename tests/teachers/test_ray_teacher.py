"""The Ray teacher worker group: one actor per DP rank, scores equal to the in-process
teacher's, shard i on actor i, an actor that dies or hangs turned into a failed call (restarted
or reported lost, by config), a trio cancellation that reaches the waiting thread, shutdown.
Seeded bugs show each check can fail.

One local Ray per module (2 CPUs, no dashboard, 127.0.0.1), shut down at the end. Skipped
without the `ray` extra.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from groupflow.impl._core import keep_ray_local

keep_ray_local()
ray = pytest.importorskip(
    "ray", reason="the Ray teacher group needs the ray extra: pip install -e '.[ray]'"
)
torch = pytest.importorskip("torch", reason="torch not installed: pip install '.[torch]'")

import trio  # noqa: E402

from groupflow.impl import (  # noqa: E402
    MemoryStore,
    RaySettings,
    RayTeacherConfig,
    RayTeacherGroup,
    ray_session,
)
from groupflow.impl._core import RaySession  # noqa: E402
from groupflow.impl._pipeline import DEFAULT_TRANSIENT_ERRORS, is_transient  # noqa: E402
from groupflow.impl._pipeline._pump import leaves  # noqa: E402
from groupflow.impl._teachers import BatchMeta, score_teacher_batch  # noqa: E402
from groupflow.impl._teachers import _ray as ray_module  # noqa: E402
from groupflow.impl._teachers._torch import PRESETS, TorchTeacher, batch_tolerance, random_rows  # noqa: E402
from groupflow.impl.contract import ScoreRequest  # noqa: E402
from groupflow.impl.errors import (  # noqa: E402
    CallOrderError,
    ConfigError,
    ScorerLost,
    ScoringTimeout,
    TeacherOutputError,
    TransientError,
)
from groupflow.model import GroupState, GroupView  # noqa: E402
from tests import ray_fakes  # noqa: E402
from tests.helpers import ROOT  # noqa: E402
from tests.ray_fakes import CRASH, HANG, RAISE, ConstantTeacher, row  # noqa: E402

pytestmark = pytest.mark.ray

CPUS = 4
"""Logical CPUs of the module's Ray: `torch_group` (two actors of half a CPU) beside another
group of two, with room for a restart, and for an actor Ray frees late (or never) after a kill
while it started, on a loaded machine."""
ACTOR_CPUS = 0.5

torch_teacher = functools.partial(TorchTeacher.from_config, PRESETS["tiny"], seed=3, device="cpu")
"""The factory each actor calls: it pickles by reference (an importable classmethod)."""


@pytest.fixture(scope="module")
def session() -> Iterator[RaySession]:
    with ray_session(RaySettings(num_cpus=CPUS)) as opened:
        assert opened.started
        assert opened.address.startswith("127.0.0.1:"), opened.address  # off the network
        assert opened.resources["CPU"] == CPUS
        yield opened
    assert not ray.is_initialized()


def config(**overrides: Any) -> RayTeacherConfig:
    settings: dict[str, Any] = {
        "dp_size": 2,
        "num_cpus_per_actor": ACTOR_CPUS,
        "call_timeout_s": 30.0,
        "start_timeout_s": 60.0,
        "name": "t",
    }
    settings.update(overrides)
    return RayTeacherConfig(**settings)


@pytest.fixture(scope="module")
def torch_group(session: RaySession) -> Iterator[RayTeacherGroup]:
    with RayTeacherGroup.start(torch_teacher, config()) as group:
        yield group


def constant_group(**overrides: Any) -> RayTeacherGroup:
    return RayTeacherGroup.start(ConstantTeacher, config(**overrides))


def pid_of(group: RayTeacherGroup, rank: int) -> int:
    pid: int = ray.get(group.actor(rank).describe.remote(), timeout=30)["pid"]
    return pid


def _in_a_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run `call` in a thread; its result or its exception lands in the returned list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dp_size", 0),
        ("num_cpus_per_actor", -1),
        ("num_gpus_per_actor", -0.5),
        ("call_timeout_s", 0),
        ("start_timeout_s", float("inf")),
        ("on_actor_loss", "retry"),
        ("max_restarts", -1),
    ],
)
def test_the_config_names_the_field_it_refuses(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        config(**{field: value})
    assert info.value.field == field
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_ray_settings_refuse_sizes_for_a_cluster() -> None:
    with pytest.raises(ConfigError) as info:
        RaySettings(address="auto", num_cpus=2)
    assert info.value.field == "num_cpus"
    assert "'auto'" in str(info.value)


def test_starting_without_ray_running_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever this process's Ray is doing (a module's session may be up), the check sees none
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(CallOrderError, match="ray_session"):
        RayTeacherGroup.start(ConstantTeacher, config())


# -- scores ------------------------------------------------------------------------------


def test_one_actor_per_rank_each_with_its_teacher(torch_group: RayTeacherGroup) -> None:
    described = torch_group.describe()
    assert [d["rank"] for d in described] == [0, 1]
    assert len({d["pid"] for d in described}) == 2
    assert torch_group.dp_size == 2


def _score(store: MemoryStore, teacher: Any, rows: list[Any]) -> dict[str, list[float]]:
    ids = [f"r{i}" for i in range(len(rows))]
    store.put(
        {
            sid: {"input_ids": list(r.input_ids), "prompt_length": r.prompt_length}
            for sid, r in zip(ids, rows, strict=True)
        }
    )
    score_teacher_batch(store, teacher, BatchMeta(tuple(ids)))
    got = store.get(ids, ["teacher_reference_logprobs"])
    return {sid: got[sid]["teacher_reference_logprobs"] for sid in ids}


def test_scores_equal_the_in_process_teacher(torch_group: RayTeacherGroup) -> None:
    """Five rows pad to six over two ranks: the group's scores equal the in-process
    teacher's (same seed, same shards) within float tolerance, and no pad row is left."""
    rows = random_rows(5, length=12, prompt=4, vocab=256, seed=7)
    local = torch_teacher(dp_size=2)
    expected = _score(MemoryStore(), local, rows)
    store = MemoryStore()
    got = _score(store, torch_group, rows)
    tolerance = batch_tolerance(torch.float32)
    for sid, values in expected.items():
        assert len(got[sid]) == len(values)
        assert max(abs(a - b) for a, b in zip(got[sid], values, strict=True)) <= tolerance, sid
    assert store.list_ids() == {f"r{i}" for i in range(5)}


def test_shard_i_goes_to_actor_i(torch_group: RayTeacherGroup) -> None:
    """Shards of 1 and 3 rows: rank 0's actor scored 1 more row, rank 1's 3 more, and each
    shard's answer is its own rows' log-probs."""
    before = [d["rows"] for d in torch_group.describe()]
    rows = random_rows(4, length=9, prompt=2, vocab=256, seed=1)
    shards = [rows[:1], rows[1:]]
    answers = torch_group.score_shards(shards)
    after = [d["rows"] for d in torch_group.describe()]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3]
    expected = torch_teacher().score_shards(shards)
    assert [len(a) for a in answers] == [1, 3]
    for got_shard, want_shard in zip(answers, expected, strict=True):
        for got, want in zip(got_shard, want_shard, strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_an_empty_shard_is_not_sent(session: RaySession) -> None:
    with constant_group() as group:
        before = [d["calls"] for d in group.describe()]
        assert group.score_shards([[row(1)], []]) == [[[-1.0] * 4], []]
        after = [d["calls"] for d in group.describe()]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0]


def test_a_teachers_own_error_comes_back_as_itself(session: RaySession) -> None:
    """A teacher that raises inside its actor raises the same class here (not a Ray
    wrapper), so the stage's failure policy sees what it would see in-process; the actor
    lives on."""
    with constant_group() as group:
        pid = pid_of(group, 0)
        with pytest.raises(ValueError, match="told to raise"):
            group.score_shards([[row(RAISE)], [row(1)]])
        assert pid_of(group, 0) == pid
        assert group.restarts == 0


def test_a_failed_rank_does_not_leave_the_others_running(session: RaySession) -> None:
    """Rank 0's teacher raises at once, rank 1's takes a second: the call raises only once
    rank 1 answered too, so no work of the call outlives it."""
    with RayTeacherGroup.start(
        functools.partial(ConstantTeacher, delay_s=1.0), config(call_timeout_s=20.0)
    ) as group:
        before = group.describe()[1]["calls"]
        started = time.monotonic()
        with pytest.raises(ValueError, match="told to raise"):
            group.score_shards([[row(RAISE)], [row(1)]])
        assert time.monotonic() - started >= 0.9, "raised while rank 1 still ran its shard"
        assert group.describe()[1]["calls"] == before + 1


def test_a_factory_that_fails_means_the_teacher_is_lost(session: RaySession) -> None:
    with pytest.raises(ScorerLost, match="no such checkpoint"):
        RayTeacherGroup.start(ray_fakes.failing_teacher, config(start_timeout_s=30.0))


# -- an actor that dies or hangs ---------------------------------------------------------


def test_a_dead_actor_is_a_retryable_failed_call_and_is_restarted(session: RaySession) -> None:
    with constant_group() as group:
        old = pid_of(group, 1)
        with pytest.raises(TransientError) as info:
            group.score_shards([[row(1)], [row(CRASH)]])
        message = str(info.value)
        assert "'t'" in message and "DP rank 1" in message and "restart 1 of" in message
        assert is_transient(info.value, DEFAULT_TRANSIENT_ERRORS)
        assert group.restarts == 1 and group.lost is None
        assert group.score_shards([[row(1)], [row(2)]]) == [[[-1.0] * 4], [[-1.0] * 4]]
        assert pid_of(group, 1) != old


def test_a_dead_actor_with_on_actor_loss_lost_loses_the_teacher(session: RaySession) -> None:
    with constant_group(on_actor_loss="lost") as group:
        with pytest.raises(ScorerLost, match="DP rank 0 died"):
            group.score_shards([[row(CRASH)], [row(1)]])
        assert group.restarts == 0
        assert group.lost is not None and "on_actor_loss='lost'" in group.lost
        with pytest.raises(ScorerLost):  # at once: nothing is sent
            group.score_shards([[row(1)], [row(1)]])


def test_restarts_beyond_max_restarts_lose_the_teacher(session: RaySession) -> None:
    with constant_group(max_restarts=1) as group:
        with pytest.raises(TransientError):
            group.score_shards([[row(CRASH)], [row(1)]])
        with pytest.raises(ScorerLost, match="max_restarts=1"):
            group.score_shards([[row(1)], [row(CRASH)]])
        assert group.restarts == 1


def test_an_actor_killed_from_outside_mid_call_is_a_failed_call(session: RaySession) -> None:
    """The drill an operator runs: `ray.kill` on one actor while it scores."""
    with constant_group(dp_size=1, num_cpus_per_actor=0.25) as group:
        slow = RayTeacherGroup.start(
            functools.partial(ConstantTeacher, delay_s=3.0), config(dp_size=1)
        )
        with slow:
            thread, out = _in_a_thread(lambda: slow.score_shards([[row(1)]]))
            time.sleep(1.0)
            ray.kill(slow.actor(0))
            thread.join(timeout=20)
            assert not thread.is_alive()
            assert isinstance(out[0], TransientError), out
            assert slow.restarts == 1
        assert group.score_shards([[row(1)]]) == [[[-1.0] * 4]]


def test_a_hung_actor_times_out_and_is_restarted(session: RaySession) -> None:
    with constant_group(call_timeout_s=5.0) as group:
        # a first call warms both ranks: the healthy one must answer well within the limit
        # even on a loaded machine, or it would be taken for hung too
        assert group.score_shards([[row(1)], [row(1)]]) == [[[-1.0] * 4], [[-1.0] * 4]]
        started = time.monotonic()
        with pytest.raises(ScoringTimeout, match=r"DP ranks \[1\] did not answer"):
            group.score_shards([[row(1)], [row(HANG)]])
        assert time.monotonic() - started < 30
        assert group.restarts == 1
        assert group.score_shards([[row(1)], [row(1)]]) == [[[-1.0] * 4], [[-1.0] * 4]]


def test_a_hung_actor_with_on_actor_loss_lost_loses_the_teacher(session: RaySession) -> None:
    with constant_group(call_timeout_s=1.0, on_actor_loss="lost") as group:
        with pytest.raises(ScorerLost) as info:
            group.score_shards([[row(HANG)], [row(1)]])
        assert isinstance(info.value.__cause__, ScoringTimeout)


async def test_a_trio_cancel_reaches_the_waiting_thread(session: RaySession) -> None:
    """The stage's call limit cancels the call: the worker thread sees it within a poll,
    kills the hung actor and returns; the scorer does not sit out `abandon_after_s`."""
    # the call's own limit is well past the abandon bound, so a thread that missed the cancel
    # is still waiting when the bound ends, however slow the machine
    group = await trio.to_thread.run_sync(functools.partial(constant_group, call_timeout_s=240.0))
    try:
        store = MemoryStore()
        store.put({"g/0": {"input_ids": list(row(HANG).input_ids), "prompt_length": 2}})
        view = GroupView("g", GroupState.SCORING, 0, ("g/0",))
        # a thread that missed the cancel would be waited for this long: past the bound below
        request = ScoreRequest("t", (view,), store, "teacher_reference_logprobs", 60.0)
        dispatched = threading.Semaphore(0)
        dispatch = group._dispatch

        def counted(rank: int, rows: list[Any]) -> Any:
            ref = dispatch(rank, rows)
            dispatched.release()
            return ref

        group._dispatch = counted  # type: ignore[method-assign]
        limit = trio.CancelScope()
        cancelled_at: list[float] = []

        async def cancel_once_both_ranks_have_the_row() -> None:
            # waits for the dispatch, not a fixed while: on a loaded machine the thread may
            # take longer than any fixed while to get there
            for _ in range(2):
                while not dispatched.acquire(blocking=False):
                    await trio.sleep(0.01)
            cancelled_at.append(trio.current_time())
            limit.cancel()

        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_both_ranks_have_the_row)
                with limit:
                    await group.score(request)
        assert limit.cancelled_caught
        assert trio.current_time() - cancelled_at[0] < 30, "the thread waited past the cancel"
        assert group.restarts == 2  # the row and its padding copy hung both ranks
        assert store.list_ids() == {"g/0"}  # the padding row is gone
    finally:
        await trio.to_thread.run_sync(group.close)


# -- shutdown ------------------------------------------------------------------------------


def test_close_kills_every_actor_and_refuses_calls(session: RaySession) -> None:
    group = constant_group()
    actors = [group.actor(0), group.actor(1)]
    group.close()
    group.close()  # idempotent
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.describe.remote(), timeout=30)
    with pytest.raises(CallOrderError, match="closed"):
        group.score_shards([[row(1)], [row(1)]])


def test_close_ends_a_call_in_flight_at_once(session: RaySession) -> None:
    group = constant_group(call_timeout_s=60.0)
    thread, out = _in_a_thread(lambda: group.score_shards([[row(HANG)], [row(1)]]))
    time.sleep(1.0)
    started = time.monotonic()
    group.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert isinstance(out[0], CallOrderError) and "closed during the call" in str(out[0]), out
    assert group.restarts == 0


def test_another_process_joins_the_cluster_by_address(session: RaySession) -> None:
    """`RaySettings(address=...)`, as on a cluster: a second process joins this Ray by its
    address, runs a worker group there, and leaves; the cluster goes on."""
    code = (
        "from groupflow.impl import RaySettings, RayTeacherConfig, RayTeacherGroup, ray_session\n"
        "from tests.ray_fakes import ConstantTeacher, row\n"
        f"with ray_session(RaySettings(address={session.address!r})) as joined:\n"
        "    config = RayTeacherConfig(dp_size=1, num_cpus_per_actor=0.25)\n"
        "    with RayTeacherGroup.start(ConstantTeacher, config) as group:\n"
        "        assert group.score_shards([[row(1)]]) == [[[-1.0] * 4]]\n"
        "    print('joined', joined.address, joined.resources['CPU'])\n"
    )
    root = ROOT
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"joined {session.address} {float(CPUS)}" in done.stdout
    assert ray.is_initialized()
    with constant_group(dp_size=1, num_cpus_per_actor=0.25) as group:
        assert group.score_shards([[row(1)]]) == [[[-1.0] * 4]]


def test_a_session_this_process_has_is_left_running(session: RaySession) -> None:
    with ray_session(RaySettings(num_cpus=1)) as inner:
        assert not inner.started
        assert inner.resources["CPU"] == CPUS
    assert ray.is_initialized()


# -- seeded bugs ---------------------------------------------------------------------------


def _shards_to_the_next_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    def dispatch(self: RayTeacherGroup, rank: int, rows: list[Any]) -> Any:
        return self._actors[(rank + 1) % len(self._actors)].score.remote(rows)

    monkeypatch.setattr(RayTeacherGroup, "_dispatch", dispatch)


def _dead_actor_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RayTeacherGroup._spawn

    def spawn(self: RayTeacherGroup, rank: int) -> Any:
        if self._actors:  # a restart: hand back the dead actor
            return self._actors[rank]
        return original(self, rank)

    monkeypatch.setattr(RayTeacherGroup, "_spawn", spawn)


def _lost_policy_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RayTeacherGroup._replace_or_lose

    def replace(self: RayTeacherGroup, ranks: list[int], what: str) -> str:
        self.config = attrs.evolve(self.config, on_actor_loss="restart")
        return original(self, ranks, what)

    monkeypatch.setattr(RayTeacherGroup, "_replace_or_lose", replace)


def _death_is_a_permanent_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_module, "TransientError", TeacherOutputError)


def _no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RayTeacherGroup._gather

    def gather(self: RayTeacherGroup, pending: dict[Any, int]) -> Any:
        self.config = attrs.evolve(self.config, call_timeout_s=600.0)
        return original(self, pending)

    monkeypatch.setattr(RayTeacherGroup, "_gather", gather)


def _first_failure_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RayTeacherGroup._gather

    def gather(self: RayTeacherGroup, pending: dict[Any, int]) -> Any:
        for ref in list(pending):
            try:
                ray.get(ref, timeout=0.2)
            except ray.exceptions.RayTaskError as error:
                raise error.cause from error
            except ray.exceptions.GetTimeoutError:
                pass
        return original(self, pending)

    monkeypatch.setattr(RayTeacherGroup, "_gather", gather)


def _cancel_not_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_module, "_cancelled_by_trio", lambda: None)


def _check_routing(session: RaySession) -> None:
    with RayTeacherGroup.start(torch_teacher, config()) as group:
        test_shard_i_goes_to_actor_i(group)


def _check_hang_bounded(session: RaySession) -> None:
    """The hang test, with a guard: a call still waiting after 10 s fails the check (and its
    actor is killed so the thread ends)."""
    with constant_group(call_timeout_s=1.5) as group:
        thread, out = _in_a_thread(lambda: group.score_shards([[row(1)], [row(HANG)]]))
        thread.join(timeout=10)
        hung = thread.is_alive()
        if hung:
            ray.kill(group.actor(1))
            thread.join(timeout=30)
        assert not hung, "the call ignored call_timeout_s"
        assert isinstance(out[0], ScoringTimeout), out


def _check_cancel(session: RaySession) -> None:
    trio.run(test_a_trio_cancel_reaches_the_waiting_thread, session)


Apply = Callable[[pytest.MonkeyPatch], None]
Check = Callable[[RaySession], None]

RAY_BUGS: dict[str, tuple[Apply, Check, str]] = {
    # name: (the bug, the check that must fail, what its failure says)
    "shard i goes to actor i+1": (
        _shards_to_the_next_actor,
        _check_routing,
        r"AssertionError: assert \[3, 1\] == \[1, 3\]",
    ),
    "a dead actor is not replaced": (
        _dead_actor_not_replaced,
        test_a_dead_actor_is_a_retryable_failed_call_and_is_restarted,
        r"ScorerLost: .*DP rank 1 failed to start",
    ),
    "on_actor_loss='lost' restarts anyway": (
        _lost_policy_restarts,
        test_a_dead_actor_with_on_actor_loss_lost_loses_the_teacher,
        r"TransientError: .*DP rank 0 died .*restarted",
    ),
    "a dead actor is a permanent error": (
        _death_is_a_permanent_error,
        test_a_dead_actor_is_a_retryable_failed_call_and_is_restarted,
        r"TeacherOutputError: .*DP rank 1 died",
    ),
    "the first failed rank ends the wait": (
        _first_failure_ends_the_wait,
        lambda session: test_a_failed_rank_does_not_leave_the_others_running(session),
        "raised while rank 1 still ran its shard",
    ),
    "call_timeout_s is not applied": (
        _no_deadline,
        _check_hang_bounded,
        "AssertionError: the call ignored call_timeout_s",
    ),
    "a trio cancel is not seen by the thread": (
        _cancel_not_seen,
        _check_cancel,
        r"ScorerLost: teacher 't' ignored cancellation",
    ),
}


def _wait_for_free_cpus(needed: float, *, within_s: float = 120.0) -> None:
    """Wait until Ray has `needed` CPUs free: the actors an earlier check killed hold theirs
    until their processes have exited, which on a loaded machine takes a while, and a group
    started before would find a rank with no CPU and fail for that, not for its seeded bug."""
    deadline = time.monotonic() + within_s
    while (free := ray.available_resources().get("CPU", 0.0)) < needed:
        if time.monotonic() > deadline:
            pytest.fail(
                f"Ray still had {free:g} of its {CPUS} CPUs free {within_s:g} s after the last "
                f"check's actors were killed ({needed:g} needed): they were not freed"
            )
        time.sleep(0.2)


@pytest.mark.parametrize("bug", sorted(RAY_BUGS))
def test_seeded_ray_bugs_are_caught(
    bug: str, session: RaySession, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply, check, says = RAY_BUGS[bug]
    _wait_for_free_cpus(2 * ACTOR_CPUS)
    apply(monkeypatch)
    # a check fails by an assertion, or by the group raising where it must not (an error
    # the check does not expect)
    with pytest.raises(Exception) as caught:
        check(session)
    failure = "\n".join(f"{type(e).__name__}: {e}" for e in leaves(caught.value))
    assert re.search(says, failure), failure[:2000]
