"""Beyond one machine, on one: a Ray cluster of two nodes, each started with `ray start` as
processes of its own (a head, and a second node with resources of its own), a teacher worker
group spread over both, and the second node killed mid-run. The group sees a failed call: with
restarts the stage retries the call's groups and the run trains every prompt once; with
`on_actor_loss="lost"` the run fails cleanly. Either way it ends in bounded time, and nothing
is lost or trained twice. Then a TransferQueue store whose storage unit dies mid-run: the run
fails naming the store, in bounded time, every prompt trained once, given up or unfinished.

One cluster for the module, stopped at its end (its processes' groups killed). Skipped
without the `ray` extra; the TransferQueue part without the `tq` extra too.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from groupflow.impl._core import keep_ray_local

keep_ray_local()
ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

import trio  # noqa: E402

from groupflow.impl import (  # noqa: E402
    RaySettings,
    RayTeacherConfig,
    RayTeacherGroup,
    ray_session,
)
from groupflow.impl._pipeline import Pipeline, RunResult  # noqa: E402
from groupflow.impl.engines import free_port  # noqa: E402
from groupflow.impl.errors import PumpFailed, ScorerLost  # noqa: E402
from tests.helpers import STEP_OF_FOUR, run_doing  # noqa: E402
from tests.pipeline.test_on_ray import PROMPTS, _pipeline  # noqa: E402
from tests.ray_fakes import ConstantTeacher  # noqa: E402

pytestmark = pytest.mark.ray

CALL_S = 1.0
"""Each teacher call takes this long: a node killed half a second into the run dies mid-call."""
BOUND_S = 180.0
"""A run that has not ended by then has hung (Ray notices a dead node within seconds)."""


@attrs.define
class Cluster:
    """Two Ray nodes on this machine, each a `ray start --block` of its own process group."""

    address: str
    head: subprocess.Popen[bytes]
    logs: Path
    second: subprocess.Popen[bytes] | None = None
    second_id: str = ""
    """The Ray node id of the second node (once a driver saw it join)."""

    def start_second(self) -> None:
        """A second node joins, with a CPU and a resource of its own (`second`)."""
        before = {n["NodeID"] for n in ray.nodes()}
        self.second = _ray_start(
            [f"--address={self.address}", "--num-cpus=1", '--resources={"second": 1}'],
            self.logs / f"second-{len(before)}.log",
        )
        deadline = time.monotonic() + 120
        while not (joined := [n for n in ray.nodes() if n["NodeID"] not in before and n["Alive"]]):
            assert time.monotonic() < deadline, "the second node did not join in 120 s"
            time.sleep(0.5)
        self.second_id = joined[0]["NodeID"]

    def kill_second(self) -> None:
        """The second node dies: its raylet, its object store and its workers, at once."""
        if self.second is not None:
            _kill_group(self.second)

    def wait_second_dead(self) -> None:
        """Until Ray has marked the killed node dead (its health checks fail)."""
        deadline = time.monotonic() + 120
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == self.second_id):
            assert time.monotonic() < deadline, "Ray did not mark the killed node dead"
            time.sleep(0.5)

    def stop(self) -> None:
        self.kill_second()
        _kill_group(self.head)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the node's processes: the `ray start` and every process under it (its raylet's
    workers run in sessions of their own, so its group alone would leave them running)."""
    for pid in [process.pid, *_descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(30)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for line in subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ray_start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`ray start ... --block`: the node lives as long as this process (its own group)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # more than one node here
    command = [str(Path(sys.executable).parent / "ray"), "start", *args]
    command += ["--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    with log.open("ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("ray-cluster")
    port = free_port()
    head = _ray_start(
        [
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            '--resources={"head": 1}',
        ],
        logs / "head.log",
    )
    started = Cluster(f"127.0.0.1:{port}", head, logs)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert head.poll() is None, (logs / "head.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the head did not start in 120 s"
            time.sleep(0.5)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def session(cluster: Cluster) -> Iterator[Any]:
    with ray_session(RaySettings(address=cluster.address)) as opened:
        yield opened


@pytest.fixture
def two_nodes(cluster: Cluster, session: Any) -> Cluster:
    """The cluster with a live second node (a fresh one after a test killed it)."""
    if cluster.second is None or cluster.second.poll() is not None:
        if cluster.second_id:
            cluster.wait_second_dead()
        cluster.start_second()
    return cluster


def _nodes_of(group: RayTeacherGroup) -> list[str]:
    return [
        ray.get(group.actor(rank).describe.remote(), timeout=60)["node"]
        for rank in range(group.dp_size)
    ]


async def _run_killing_the_second_node(
    cluster: Cluster, policy: str, **group_config: Any
) -> tuple[Pipeline, RayTeacherGroup, RunResult | BaseException, float]:
    """A run whose teacher group has a rank on each node; half a second in, the second node
    dies. What the run returned or raised, and how long it took."""
    from groupflow.impl import MemoryStore

    config = RayTeacherConfig(
        dp_size=2,
        num_cpus_per_actor=1,
        call_timeout_s=60,
        start_timeout_s=120,
        name="teacher",
        spread=True,
        **group_config,
    )
    make = functools.partial(ConstantTeacher, delay_s=CALL_S)
    group = await trio.to_thread.run_sync(RayTeacherGroup.start, make, config)
    nodes = await trio.to_thread.run_sync(_nodes_of, group)
    assert len(set(nodes)) == 2, f"the ranks share a node: {nodes}"
    assert cluster.second_id in nodes
    pipeline = _pipeline(MemoryStore(), group, policy)  # type: ignore[arg-type]
    started = trio.current_time()
    try:
        outcome = await run_doing(pipeline, 0.5, cluster.kill_second, bound_s=BOUND_S)
    finally:
        await trio.to_thread.run_sync(group.close)
    return pipeline, group, outcome, trio.current_time() - started


def _each_prompt_once(pipeline: Pipeline, result: RunResult, *, store_alive: bool = True) -> None:
    """Trained once (the learner saw it in one step), given up, or unfinished: one of them. A
    step the learner took whose end failed (its rows could not be released) is not trained:
    its prompts are unfinished, trained again on resume from the checkpoint before it."""
    seen = [g.ordinal for b in pipeline.train.learner.batches for g in b.groups]  # type: ignore[attr-defined]
    assert len(seen) == len(set(seen)), f"trained twice: {sorted(seen)}"
    assert result.trained <= set(seen) and set(seen) - result.trained <= result.unfinished
    sets = [result.trained, result.shortfall, result.unfinished]
    assert sum(len(s) for s in sets) == len(frozenset().union(*sets)), sets
    assert frozenset().union(*sets) == frozenset(range(pipeline.ledger.cursor))
    if store_alive:
        assert not pipeline.buffer.store.list_ids(), "rows left in the store"


async def test_a_node_killed_mid_run_is_a_failed_call_the_stage_retries(
    two_nodes: Cluster,
) -> None:
    pipeline, group, outcome, took = await _run_killing_the_second_node(two_nodes, "retry")
    assert isinstance(outcome, RunResult), repr(outcome)
    assert outcome.trained == frozenset(range(PROMPTS)) and not outcome.shortfall
    assert group.restarts == 1, "the rank on the dead node was not replaced"
    _each_prompt_once(pipeline, outcome)
    assert took < BOUND_S


async def test_a_node_killed_with_on_actor_loss_lost_fails_the_run_cleanly(
    two_nodes: Cluster,
) -> None:
    pipeline, group, outcome, _ = await _run_killing_the_second_node(
        two_nodes, "retry", on_actor_loss="lost"
    )
    assert isinstance(outcome, PumpFailed), repr(outcome)
    assert isinstance(outcome.__cause__, ScorerLost), repr(outcome.__cause__)
    assert outcome.result is not None
    _each_prompt_once(pipeline, outcome.result)


def test_a_local_session_never_joins_a_cluster_this_machine_ran_before(cluster: Cluster) -> None:
    """`ray_session()` without an address starts a Ray of its own, even with `RAY_ADDRESS`
    naming a cluster (here one that is running, in another process's test)."""
    code = (
        "from groupflow.impl import RaySettings, ray_session\n"
        "with ray_session(RaySettings(num_cpus=1)) as s:\n"
        "    assert s.started and s.resources['CPU'] == 1, s\n"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _storage_pids() -> list[int]:
    """The processes of TransferQueue's storage units (Ray names a worker by its actor)."""
    listed = subprocess.run(
        ["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [
        int(line.split()[0]) for line in listed.splitlines() if "ray::SimpleStorageUnit" in line
    ]


@pytest.mark.tq
async def test_a_store_whose_storage_process_dies_fails_the_run_naming_it(
    two_nodes: Cluster,
) -> None:
    """Half a second into a run, the process of TransferQueue's storage unit dies: the run
    fails in bounded time with the store's error, and every prompt is in one place."""
    pytest.importorskip("transfer_queue", reason="needs the tq extra: pip install -e '.[tq]'")
    from groupflow.impl import PipelineConfig, build_pipeline
    from groupflow.impl._core._tq_store import TransferQueueStore
    from groupflow.impl.errors import StoreError
    from groupflow.impl.testing import FakeLearner
    from tests.pipeline.test_on_ray import TokenGenerator

    open_store = functools.partial(TransferQueueStore.open, storage_units=1, timeout_s=10)
    store = await trio.to_thread.run_sync(open_store)
    pipeline = build_pipeline(
        PipelineConfig(
            shape=STEP_OF_FOUR.evolve(max_batch_groups=2),
            shutdown_timeout_s=30,
        ),
        prompts=list(range(64)),
        generator=TokenGenerator(),
        learner=FakeLearner(latency=0.05),
        store=store,
        train_fields=["input_ids", "generation_logprobs"],
    )

    def kill_storage() -> None:
        pids = _storage_pids()
        assert pids, "no storage unit process to kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    try:
        failure = await run_doing(pipeline, 0.5, kill_storage, bound_s=BOUND_S)
    finally:
        with trio.move_on_after(60):
            await trio.to_thread.run_sync(store.close)
    assert isinstance(failure, PumpFailed), repr(failure)
    chain: list[BaseException] = []
    error: BaseException | None = failure
    while error is not None:
        chain.append(error)
        error = error.__cause__
    assert any(isinstance(e, StoreError) for e in chain), [repr(e) for e in chain]
    result = failure.result
    assert result is not None and result.trained, "the run trained nothing before the death"
    _each_prompt_once(pipeline, result, store_alive=False)  # its rows died with it
