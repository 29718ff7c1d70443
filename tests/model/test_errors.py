"""Errors by who caused them: one base, four categories, each error also a builtin, internal
errors that say they are a bug, and the same mistake raising the same class everywhere."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest

from groupflow.impl import (
    BufferConfig,
    MemoryStore,
    PipelineConfig,
    ReplayBuffer,
    Row,
    ScoringConfig,
)
from groupflow.impl._core import PromptLedger
from groupflow.impl.errors import (
    ConfigError,
    GroupflowError,
    IllegalTransition,
    InternalError,
    MissingDataError,
)
from groupflow.model import Actor, GroupState, errors
from groupflow.model.errors import (
    BackpressureError,
    ExternalError,
    LedgerInconsistent,
    PumpFailed,
    UsageError,
)
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.shape import Shape

CATEGORIES = (UsageError, ExternalError, BackpressureError, InternalError)
CLASSES = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
GROUPS = [c for c in CLASSES if any(o is not c and issubclass(o, c) for o in CLASSES)]
"""Bases of other errors: the categories and groups such as `StoreError`."""
LEAVES = [c for c in CLASSES if c not in GROUPS]


def test_the_module_lists_every_class() -> None:
    assert {c.__name__ for c in CLASSES} <= set(errors.__all__)


@pytest.mark.parametrize("cls", [c for c in CLASSES if c is not GroupflowError], ids=str)
def test_every_error_has_one_category(cls: type[Exception]) -> None:
    assert issubclass(cls, GroupflowError)
    categories = [c.__name__ for c in CATEGORIES if issubclass(cls, c)]
    assert len(categories) == (0 if cls is PumpFailed else 1), categories


@pytest.mark.parametrize("cls", LEAVES, ids=str)
def test_every_error_is_also_a_builtin(cls: type[Exception]) -> None:
    builtins = {b for b in cls.__mro__ if b.__module__ == "builtins"}
    assert builtins - {Exception, BaseException, object}, cls


def test_internal_errors_say_they_are_a_bug() -> None:
    ledger = PromptLedger(num_prompts=2)
    with pytest.raises(LedgerInconsistent) as info:
        ledger.mark_trained([0])
    assert "bug in groupflow" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_config_errors_name_the_field() -> None:
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: BufferConfig(group_size=0, capacity=4), "group_size"),
        (lambda: BufferConfig(group_size=2, capacity=4, sampler="random"), "sampler"),
        (lambda: ScoringConfig(flush_after_s=0), "flush_after_s"),
        (lambda: ScoringConfig(flush_after_s=1, design="x"), "design"),
        (
            lambda: PipelineConfig(
                shape=Shape(
                    prompts_per_step=4,
                    num_generations_per_prompt=2,
                    max_inflight_prompts=4,
                    max_buffered_groups=2,
                ),
            ),
            "max_buffered_groups",
        ),
        (lambda: Bounds(prompts=0), "prompts"),
    ]
    for build, field in cases:
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.field == field
        assert field in str(info.value)


async def test_a_finished_group_refuses_every_change_with_the_same_error() -> None:
    """Releasing a finished group used to raise ValueError where retrying one raised
    IllegalTransition: the same mistake now raises the same class."""
    buffer = ReplayBuffer(BufferConfig(group_size=1, capacity=2), MemoryStore())
    gid = buffer.reserve(target_step=0)
    await buffer.commit(gid, [Row("r", {"x": 1})], start_weight_version=0, end_weight_version=0)
    selection = buffer.select(step=0, weight_version=0)
    await buffer.release(selection.group_ids)
    calls: list[Callable[[], object]] = [
        lambda: buffer.retry(gid),
        lambda: buffer.take_for_scoring([gid]),
        lambda: buffer.group(gid),
    ]
    for call in calls:
        with pytest.raises(IllegalTransition) as info:
            call()
        assert (info.value.group_id, info.value.state) == (gid, GroupState.CONSUMED)
    with pytest.raises(IllegalTransition) as info:
        await buffer.release([gid])
    assert (info.value.group_id, info.value.state) == (gid, GroupState.CONSUMED)
    with pytest.raises(IllegalTransition):
        await buffer.discard(gid, actor=Actor.SUPERVISOR)


def test_errors_survive_pickling_with_their_details() -> None:
    """An error raised in another process (a remote store or teacher) arrives whole."""
    config = ConfigError(
        "BufferConfig.capacity must be a positive int", field="max_buffered_groups"
    )
    illegal = IllegalTransition(
        "no", group_id="g1", state=GroupState.READY, event=None, actor=Actor.TRAIN
    )
    missing = MissingDataError("the store has no rows ['x']", rows=["x"], fields={"y": ["f"]})
    for error in (config, illegal, missing, LedgerInconsistent("twice")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert vars(copy) == vars(error)
