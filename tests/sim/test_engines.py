"""The simulated inference fleet (`groupflow.sim.engines`): engine batching slows sequences as
an engine fills, a weight sync waits for or pauses in-flight generation and takes its time in
the train step, and a prompt issued again draws afresh.

Seeded bugs, each caught by the test named after it: an engine whose rate is read once at the
start of a rollout; an engine that forgets the tokens of a rollout that left it; a weight sync
that lets rollouts start while it loads; failures keyed by the prompt alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl.contract import GenerateRequest
from groupflow.sim.engines import EngineGenerator, EngineModel, WeightSyncModel
from groupflow.sim.run import PUMP_DEMAND, simulate
from groupflow.sim.scenario import load_scenario, parse_scenario, scenario_toml

BASE = """
name = "t"
steps = 4
[pipeline]
prompts_per_step = 4
num_generations_per_prompt = 2
max_inflight_prompts = 4
max_buffered_groups = 8
[scoring]
max_batch_groups = 3
flush_after_s = 1.0
[generation]
median_s = 10.0
[teachers.teacher]
fixed_s = 0.5
[train]
step_s = 2.0
"""


def request(ordinal: int, generations: int = 2) -> GenerateRequest:
    return GenerateRequest(ordinal, None, None, generations, 0)


def test_the_slowdown_curve_interpolates_and_holds_past_its_ends() -> None:
    model = EngineModel(engines=1, slowdown=[[1, 1.0], [8, 1.5], [32, 3.0]])
    assert model.factor(1) == 1.0
    assert model.factor(4) == pytest.approx(1.0 + 0.5 * 3 / 7)
    assert model.factor(8) == 1.5
    assert model.factor(20) == pytest.approx(2.25)
    assert model.factor(100) == 3.0


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"engines": 0}, "engines must be an int >= 1"),
        ({"slowdown": [[4, 1.0], [2, 1.5]]}, "must rise"),
        ({"slowdown": [[1, 0.5]]}, "factor a finite number >= 1"),
        ({"slowdown": "fast"}, "list of \\[sequences, factor\\] points"),
        ({"slowdown": []}, "at least one"),
        ({"per_token": -1e-4}, "per_token must be a finite number >= 0"),
        ({"per_token": "1e-4"}, "per_token must be a finite number >= 0"),
        ({"per_token": 1e-4}, "per_token = 0.0001 needs \\[generation\\] tokens"),
        ({"lockstep": "yes"}, "lockstep must be true or false"),
    ],
)
def test_a_bad_engine_table_is_refused_naming_the_key(table: dict[str, Any], match: str) -> None:
    text = (
        BASE + "[engines]\n" + "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in table.items())
    )
    with pytest.raises(ValueError, match=match):
        parse_scenario(text, source="t.toml")


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ('mode = "later"', "mode must be one of"),
        ("fixed_s = -1.0", "fixed_s must be a finite number >= 0"),
        ("per_param_s = nan", "per_param_s must be a finite number >= 0"),
        ("idle_s = -0.5", "idle_s must be a finite number >= 0"),
        ("idle_spread = [-1.0]", "idle_spread must be a list of finite numbers > 0"),
        (
            'mode = "interrupt"\nidle_s = 0.1',
            'idle_s, idle_spread and drain apply to mode = "wait"',
        ),
        ('mode = "interrupt"\ndrain = 1.5', 'idle_s, idle_spread and drain apply to mode = "wait"'),
        ("drain = 0.5", "drain must be >= 1"),
        ('mode = "wait"\ndrain = 1.5\n[engines]\nbatching = false', "drop one of them"),
        ("drain = -1.0", "drain must be a finite number >= 0"),
        ("bogus = 1", "bogus"),
    ],
)
def test_a_bad_weight_sync_table_is_refused_naming_the_key(table: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_scenario(BASE + "[weight_sync]\n" + table + "\n", source="t.toml")


async def _finish_times(generator: EngineGenerator, starts: dict[int, float]) -> dict[int, float]:
    done: dict[int, float] = {}

    async def one(ordinal: int, at: float) -> None:
        await trio.sleep(at)
        await generator.generate(request(ordinal))
        done[ordinal] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for ordinal, at in starts.items():
            nursery.start_soon(one, ordinal, at)
    return done


async def test_sequences_slow_as_their_engine_fills_and_speed_up_when_it_empties(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # two sequences per rollout: alone a rollout's factor is 1.5 (2 sequences), together 2.0
    model = EngineModel(engines=1, slowdown=[[2, 1.5], [4, 2.0]])
    generator = EngineGenerator(latency=lambda o, a: 10.0, model=model)
    done = await _finish_times(generator, {0: 0.0, 1: 5.0})
    # rollout 0: 5 s alone at 1.5 (3.33 s of work), then 6.67 s of work at 2.0 (13.33 s): 18.33
    assert done[0] == pytest.approx(5.0 + (10.0 - 5.0 / 1.5) * 2.0)
    # rollout 1: 13.33 s together (6.67 s of work), then 3.33 s of work alone at 1.5 (5 s)
    assert done[1] == pytest.approx(done[0] + (10.0 - (done[0] - 5.0) / 2.0) * 1.5)


@pytest.mark.parametrize("key", ["per_token = 1e-4", "lockstep = true"])
def test_what_only_a_batching_engine_does_is_refused_on_one_that_serves_one_rollout(
    key: str,
) -> None:
    with pytest.raises(ValueError, match="batching = false serves one at a time"):
        parse_scenario(BASE + f"[engines]\n{key}\nbatching = false\n", source="t.toml")


def test_the_tokens_served_at_once_add_to_the_slowdown() -> None:
    model = EngineModel(slowdown=[[1, 1.0], [8, 1.5]], per_token=1e-3)
    assert model.factor(1) == 1.0
    assert model.factor(8, 400) == pytest.approx(1.5 + 0.4)


def _by_tokens(tokens: dict[int, int]) -> EngineGenerator:
    """One engine whose sequences slow by a tenth of their time alone per 100 tokens it
    serves, and by nothing else; prompt `o`'s group carries `tokens[o]` tokens."""
    model = EngineModel(engines=1, per_token=1e-3)
    return EngineGenerator(latency=lambda o, a: 10.0, tokens=lambda o, a: tokens[o], model=model)


async def test_long_sequences_slow_their_neighbours_more_than_short_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two rollouts of 100 and 900 tokens together each go at 1 / (1 + 1.0); one of 900
    tokens alone at 1 / 1.9 (its own count too), and the engine ends serving no tokens."""
    generator = _by_tokens({0: 100, 1: 900, 2: 900})
    done = await _finish_times(generator, {0: 0.0, 1: 0.0})
    assert done[0] == pytest.approx(20.0)
    assert done[1] == pytest.approx(20.0)
    again = await _finish_times(generator, {2: 0.0})
    assert again[2] == pytest.approx(done[1] + 19.0)  # 10 s of work at 1 / 1.9
    assert generator.engines[0].tokens == 0


async def test_seeded_bug_tokens_kept_after_their_rollout_left_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the engine adds a rollout's tokens when it starts and never takes them
    away, so it slows for sequences long gone."""
    leave = EngineGenerator._leave
    monkeypatch.setattr(
        EngineGenerator,
        "_leave",
        lambda self, engine, size, tokens, waiter: leave(self, engine, size, 0, waiter),
    )
    with pytest.raises(AssertionError):
        await test_long_sequences_slow_their_neighbours_more_than_short_ones(autojump_clock)


def test_a_scenarios_tokens_served_at_once_slow_its_run_and_read_back() -> None:
    """The term reaches a whole simulated run through the scenario file: long groups on a
    full engine lengthen the steps, and the file reads back as written."""
    tokens = BASE.replace("median_s = 10.0", "median_s = 10.0\ntokens = 2000")
    plain = parse_scenario(tokens)
    priced = parse_scenario(tokens + "[engines]\nper_token = 1e-4\n")
    assert priced.engines.per_token == 1e-4
    assert parse_scenario(scenario_toml(priced)) == priced
    slower = simulate(priced, PUMP_DEMAND).s_per_step
    assert slower > 1.3 * simulate(plain, PUMP_DEMAND).s_per_step


async def test_rollouts_that_start_together_in_lockstep_end_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With lockstep, the rollouts that start at one instant on an engine take the time alone
    of the first to arrive, whatever they drew; one that starts later draws its own, and so does
    each on an engine of its own."""
    drawn = {0: 10.0, 1: 30.0, 2: 20.0, 3: 40.0}
    generator = EngineGenerator(latency=lambda o, a: drawn[o], model=EngineModel(lockstep=True))
    done = await _finish_times(generator, {0: 0.0, 1: 0.0, 2: 5.0})
    assert done[0] == done[1] in (10.0, 30.0)  # the draw of whichever trio ran first
    assert done[2] == 25.0
    free = EngineGenerator(latency=lambda o, a: drawn[o], model=EngineModel())
    now = trio.current_time()
    assert await _finish_times(free, {0: 0.0, 1: 0.0}) == {0: now + 10.0, 1: now + 30.0}
    apart = EngineGenerator(
        latency=lambda o, a: drawn[o], model=EngineModel(engines=2, lockstep=True)
    )
    now = trio.current_time()
    assert await _finish_times(apart, {1: 0.0, 3: 0.0}) == {1: now + 30.0, 3: now + 40.0}


async def test_seeded_bug_lockstep_across_engines_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the fleet keeps one latest start, so rollouts that start together on
    different engines share a time too."""
    alone = EngineGenerator._alone
    monkeypatch.setattr(
        EngineGenerator, "_alone", lambda self, engine, o, a: alone(self, self.engines[0], o, a)
    )
    with pytest.raises(AssertionError):
        await test_rollouts_that_start_together_in_lockstep_end_together(autojump_clock)


async def test_rollouts_spread_over_engines(autojump_clock: trio.testing.MockClock) -> None:
    model = EngineModel(engines=2, slowdown=[[2, 1.0], [4, 2.0]])
    generator = EngineGenerator(latency=lambda o, a: 10.0, model=model)
    done = await _finish_times(generator, {0: 0.0, 1: 0.0})
    assert done == {0: pytest.approx(10.0), 1: pytest.approx(10.0)}  # one per engine
    assert {engine for _, engine, n in generator.load if n} == {0, 1}


async def test_seeded_bug_rate_read_once_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: a rollout's rate is fixed when it starts; it never speeds up when its
    engine empties (nor slows when it fills)."""

    async def once(self: EngineGenerator, engine: Any, waiter: Any) -> None:
        self._advance(engine)
        await trio.sleep((waiter.target - engine.work) * self.model.factor(engine.sequences))

    monkeypatch.setattr(EngineGenerator, "_work", once)
    model = EngineModel(engines=1, slowdown=[[2, 1.5], [4, 2.0]])
    generator = EngineGenerator(latency=lambda o, a: 10.0, model=model)
    done = await _finish_times(generator, {0: 0.0, 1: 5.0})
    with pytest.raises(AssertionError):
        assert done[0] == pytest.approx(5.0 + (10.0 - 5.0 / 1.5) * 2.0)


async def test_a_waiting_sync_starts_after_generation_and_holds_new_rollouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sync = WeightSyncModel(fixed_s=1.0, per_param_s=1e-9, params=2e9, mode="wait")
    generator = EngineGenerator(latency=lambda o, a: 10.0, sync=sync)
    done: dict[str, float] = {}

    async def rollout(name: str, ordinal: int, at: float) -> None:
        await trio.sleep(at)
        await generator.generate(request(ordinal))
        done[name] = trio.current_time()

    async def step() -> None:
        await trio.sleep(4.0)
        await generator.sync_weights(1)
        done["sync"] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rollout, "running", 0, 0.0)
        nursery.start_soon(rollout, "later", 1, 5.0)
        nursery.start_soon(step)
    assert done["running"] == pytest.approx(10.0)  # not paused
    assert done["sync"] == pytest.approx(10.0 + 3.0)  # waited for it, then 1 + 2 s
    assert done["later"] == pytest.approx(13.0 + 10.0)  # started only after the sync
    assert generator.sync_seconds == pytest.approx(9.0)
    assert generator.synced == [1]


@pytest.mark.parametrize(("running", "seconds"), [(True, 10.0 + 3.0), (False, 4.0 + 0.5)])
async def test_a_waiting_sync_that_finds_nothing_in_flight_costs_its_idle_seconds(
    autojump_clock: trio.testing.MockClock, running: bool, seconds: float
) -> None:
    """`idle_s` is what a sync costs when no rollout is in flight at its start; one that
    waited for a rollout costs `fixed_s` after it."""
    sync = WeightSyncModel(fixed_s=3.0, idle_s=0.5, mode="wait")
    generator = EngineGenerator(latency=lambda o, a: 10.0 if running else 1.0, sync=sync)

    async def step() -> None:
        await trio.sleep(4.0)
        await generator.sync_weights(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generator.generate, request(0))
        nursery.start_soon(step)
    assert trio.current_time() == pytest.approx(seconds)


@pytest.mark.parametrize("drain", [1.0, 2.0])
async def test_a_waiting_sync_drains_the_rollouts_in_flight_drain_times_slower(
    autojump_clock: trio.testing.MockClock, drain: float
) -> None:
    """A rollout of 10 s with 6 s left at the sync's start ends `drain` times later; one that
    starts after the sync goes at its own speed again."""
    sync = WeightSyncModel(fixed_s=1.0, mode="wait", drain=drain)
    generator = EngineGenerator(latency=lambda o, a: 10.0, sync=sync)
    done: dict[str, float] = {}

    async def rollout(name: str, ordinal: int, at: float) -> None:
        await trio.sleep(at)
        await generator.generate(request(ordinal))
        done[name] = trio.current_time()

    async def step() -> None:
        await trio.sleep(4.0)
        await generator.sync_weights(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rollout, "running", 0, 0.0)
        nursery.start_soon(rollout, "later", 1, 5.0)
        nursery.start_soon(step)
    assert done["running"] == pytest.approx(4.0 + 6.0 * drain)
    assert done["later"] == pytest.approx(4.0 + 6.0 * drain + 1.0 + 10.0)


async def test_an_interrupting_sync_pauses_in_flight_generation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sync = WeightSyncModel(fixed_s=3.0, mode="interrupt")
    generator = EngineGenerator(latency=lambda o, a: 10.0, sync=sync)
    done: dict[str, float] = {}

    async def rollout() -> None:
        await generator.generate(request(0))
        done["rollout"] = trio.current_time()

    async def step() -> None:
        await trio.sleep(4.0)
        await generator.sync_weights(1)
        done["sync"] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rollout)
        nursery.start_soon(step)
    assert done["sync"] == pytest.approx(7.0)  # at once, 3 s
    assert done["rollout"] == pytest.approx(13.0)  # paused 3 s
    assert generator.sync_seconds == pytest.approx(3.0)


async def test_seeded_bug_rollouts_start_during_a_sync_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the sync forgets to hold new rollouts (they start on old weights)."""
    original = EngineGenerator.sync_weights

    async def leaky(self: EngineGenerator, version: int) -> None:
        async def clear() -> None:
            await trio.sleep(0)
            self._syncing = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(clear)
            await original(self, version)

    monkeypatch.setattr(EngineGenerator, "sync_weights", leaky)
    sync = WeightSyncModel(fixed_s=5.0, mode="wait")
    generator = EngineGenerator(latency=lambda o, a: 1.0, sync=sync)
    started: list[float] = []

    async def later() -> None:
        await trio.sleep(1.0)
        await generator.generate(request(1))
        started.append(trio.current_time() - 1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generator.sync_weights, 1)
        nursery.start_soon(later)
    with pytest.raises(AssertionError):
        assert started[0] >= 5.0


def test_the_sync_is_part_of_the_step_and_in_the_report() -> None:
    free = parse_scenario(BASE)
    priced = parse_scenario(BASE + '[weight_sync]\nfixed_s = 2.0\nmode = "interrupt"\n')
    a = simulate(free, PUMP_DEMAND)
    b = simulate(priced, PUMP_DEMAND)
    assert a.sync_s == 0.0
    assert b.sync_s == pytest.approx(2.0 * b.steps)
    assert b.s_per_step > a.s_per_step
    assert any(s.kind == "sync" for s in b.spans)


def _outcomes_by_prompt(result: Any) -> dict[str, list[bool]]:
    """Each prompt's rollouts that ended by themselves (not cancelled by the crash), in order:
    whether each went through."""
    out: dict[str, list[bool]] = {}
    for span in sorted(result.spans, key=lambda s: s.start):
        if span.kind == "generate" and not span.detail.endswith("cancelled"):
            out.setdefault(span.lane, []).append(span.ok)
    return out


def _again(result: Any) -> dict[str, list[bool]]:
    return {o: oks for o, oks in _outcomes_by_prompt(result).items() if len(oks) > 1}


def test_a_prompt_issued_again_draws_afresh() -> None:
    """In `faults`, the crash issues prompts again: some that failed go through the second
    time and some that went through fail, and a first attempt draws what it always did."""
    scenario = load_scenario("faults")
    again = _again(simulate(scenario, PUMP_DEMAND))
    assert any(len(set(oks)) > 1 for oks in again.values()), again
    assert scenario.generation.sample(0, 5) == scenario.generation.sample(0, 5, 0)
    assert scenario.generation.sample(0, 5, 1) != scenario.generation.sample(0, 5, 0)


def test_seeded_bug_failures_keyed_by_the_prompt_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the rollout's failure draw ignores the attempt."""
    import groupflow.sim.run as run_module
    from groupflow.sim.spread import rng as original

    def by_prompt(seed: int, *key: object) -> Any:
        if key and key[0] == "rollout-fail":
            key = key[:2]
        return original(seed, *key)

    monkeypatch.setattr(run_module, "rng", by_prompt)
    again = _again(simulate(load_scenario("faults"), PUMP_DEMAND))
    assert again, "the crash should issue prompts again"
    with pytest.raises(AssertionError):
        assert any(len(set(oks)) > 1 for oks in again.values()), again
