"""The pipeline machine's doubles: a generator, teacher scorers and a learner that do nothing
until the machine says so, and the teachers they score on.

A rollout waits until `HeldGenerator.finish`, a teacher call until `HeldScorer.finish` (on trio
events, or on asyncio's for the machine's asyncio variant, where they are asyncio parts); the
teachers behind the scorer are `ArithmeticTeacher`s (no torch), `TorchTeacher`s on the tiny
preset, or served ones (`teacher_bank`), and `CheckingLearner` checks every row it trains on
against what the row's teacher gives it alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import trio

from groupflow.impl import TEACHER_FIELD
from groupflow.impl._teachers import TEACHER_INPUTS, score_request
from groupflow.impl.contract import GenerateRequest, ScoreRequest, Teacher, TokenRow, TrainBatch
from groupflow.model.errors import TeacherOutputError

ROW_LENGTHS = (4, 5, 7)
"""Rows of a group differ in length, so a batch pads rows inside the forward pass too."""
PROMPT_LENGTH = 2
VOCAB = 256
"""Token ids below the tiny torch preset's vocabulary."""


def tokens_of(ordinal: int, index: int) -> tuple[int, ...]:
    """The `index`-th generation of prompt `ordinal`: fixed, so any row can be scored again."""
    length = ROW_LENGTHS[(ordinal + index) % len(ROW_LENGTHS)]
    return tuple((ordinal * 37 + index * 11 + j * 5 + 3) % VOCAB for j in range(length))


class _Event(Protocol):
    def set(self) -> None: ...

    async def wait(self) -> Any: ...


@attrs.define
class _Held:
    """One call the outside world has not answered yet."""

    done: _Event
    fail: str | None = None
    started: float = 0.0


@attrs.define
class HeldGenerator:
    """Each rollout waits until `finish(ordinal, fail=...)`. `event` makes what it waits on
    (`trio.Event`; `asyncio.Event` for an asyncio part)."""

    fields: frozenset[str] = frozenset({"input_ids", "prompt_length", "generation_logprobs"})
    pending: dict[int, _Held] = attrs.field(factory=dict)
    event: Callable[[], _Event] = trio.Event

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        assert request.ordinal not in self.pending, f"prompt {request.ordinal} generated twice"
        held = self.pending[request.ordinal] = _Held(self.event())
        try:
            await held.done.wait()
        finally:
            self.pending.pop(request.ordinal, None)
        if held.fail:
            raise RuntimeError(f"rollout of prompt {request.ordinal} failed (by the machine)")
        return [
            {
                "input_ids": list(tokens_of(request.ordinal, i)),
                "prompt_length": PROMPT_LENGTH,
                "generation_logprobs": [-1.0],
            }
            for i in range(request.num_generations)
        ]

    def finish(self, ordinal: int, *, fail: bool) -> None:
        held = self.pending[ordinal]
        held.fail = "failed" if fail else None
        held.done.set()

    async def sync_weights(self, version: int) -> None:
        return None


@attrs.frozen
class ArithmeticTeacher:
    """A `Teacher` without torch: a response token's log-prob is a fixed function of the
    token, its position and the teacher's seed, so what every row should get is known."""

    seed: int
    dp_size: int = 1

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        return [[self.expected(row) for row in shard] for shard in shards]

    def expected(self, row: TokenRow) -> list[float]:
        return [
            -(((token * 31 + position * 7 + self.seed) % 97) + 1) / 100
            for position, token in enumerate(row.input_ids)
            if position >= row.prompt_length
        ]


@attrs.frozen
class _Raising:
    """A teacher whose forward pass fails (after the batch was padded and sharded)."""

    teacher: Teacher

    @property
    def dp_size(self) -> int:
        return self.teacher.dp_size

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        raise OSError("teacher forward pass failed (by the machine)")


@attrs.frozen
class _Garbage:
    """A teacher that returns one log-prob too many for every row (a permanent failure)."""

    teacher: Teacher

    @property
    def dp_size(self) -> int:
        return self.teacher.dp_size

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        return [[[-1.0] * (row.response_length + 1) for row in shard] for shard in shards]


FAILURES: dict[str, Callable[[Teacher], Teacher]] = {"raises": _Raising, "garbage": _Garbage}
"""How a teacher call the machine fails goes wrong: a transient error, or bad output."""

VERIFIER = "verifier"
"""The second stage some setups draw (`Setup.verifier`): it writes `REWARD_FIELD`."""
REWARD_FIELD = "reward"
VERIFIER_FAILURES: dict[str, type[Exception]] = {"raises": OSError, "garbage": ValueError}
"""How a verifier call the machine fails goes wrong: transient, or permanent."""


def reward_of(input_ids: Sequence[int]) -> float:
    """What the machine's verifier writes for a row: a fixed function of its tokens."""
    return float(sum(input_ids) % 3)


@attrs.frozen
class TeacherBank:
    """The physical teachers of one example, and what each should write for a row. With
    `served`, the teachers are served (`ServedTeachers`: real HTTP calls to a real server) and
    `teachers` only names them, with their replica counts as DP sizes."""

    teachers: Mapping[str, Any]
    reference: Callable[[str, TokenRow], list[float]]
    tolerance: float
    served: Any = None


@attrs.frozen
class Served:
    """A server the machine's teachers are scored on (`scorer="served"`): its URL and the
    Hugging Face folder it serves (what the written log-probs are checked against)."""

    url: str
    model: Path


SERVED_TOLERANCE = 2e-3
"""How far a served float32 log-prob may be from transformers' on the same weights."""

_hf_models: dict[Path, Any] = {}
"""The served folders' models in transformers, loaded once per process."""


def _served_bank(served: Served, dp_sizes: Mapping[str, int]) -> TeacherBank:
    import torch
    import transformers

    from groupflow.impl.engines import ServedTeachers

    if served.model not in _hf_models:
        _hf_models[served.model] = transformers.AutoModelForCausalLM.from_pretrained(
            served.model, local_files_only=True, dtype=torch.float32
        )  # in eval mode, as from_pretrained leaves it
    model = _hf_models[served.model]

    def reference(name: str, row: TokenRow) -> list[float]:
        with torch.inference_mode():
            ids = torch.tensor([row.input_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        return [
            float(logp[p - 1, row.input_ids[p]])
            for p in range(row.prompt_length, len(row.input_ids))
        ]

    # a teacher of DP size n is n replicas: its calls split their rows over n requests
    scorer = ServedTeachers({n: [served.url] * dp for n, dp in dp_sizes.items()})
    return TeacherBank(dict(dp_sizes), reference, SERVED_TOLERANCE, served=scorer)


_torch_models: dict[tuple[int, str], Any] = {}
"""Torch teachers' models by (seed, device): built once per process, not once per example."""


def teacher_bank(
    scorer: str, device: str, dp_sizes: Mapping[str, int], served: Served | None = None
) -> TeacherBank:
    """`fake`: `ArithmeticTeacher`s; `torch`: `TorchTeacher`s on the tiny preset, each checked
    against a forward pass of its model on the row alone (`reference_logprobs`); `served`: the
    teachers on the server `served`, checked against transformers on the folder it serves."""
    if scorer == "served":
        if served is None:
            raise ValueError("scorer='served' needs the server: served=Served(url, model)")
        return _served_bank(served, dp_sizes)
    seeds = {name: i for i, name in enumerate(sorted(dp_sizes))}
    if scorer == "fake":
        fakes = {n: ArithmeticTeacher(seeds[n], dp) for n, dp in dp_sizes.items()}
        return TeacherBank(fakes, lambda name, row: fakes[name].expected(row), 0.0)
    from groupflow.impl._teachers._torch import (
        PRESETS,
        TorchTeacher,
        batch_tolerance,
        reference_logprobs,
        resolve_device,
    )

    where = str(resolve_device(device))
    models = {}
    for name, seed in seeds.items():
        key = (seed, where)
        if key not in _torch_models:
            _torch_models[key] = TorchTeacher.from_config(
                PRESETS["tiny"], seed=seed, device=where
            ).model
        models[name] = _torch_models[key]
    teachers = {n: TorchTeacher(models[n], dp_size=dp, device=where) for n, dp in dp_sizes.items()}
    tolerance = batch_tolerance(next(iter(teachers.values())).dtype)
    return TeacherBank(teachers, lambda name, row: reference_logprobs(models[name], row), tolerance)


@attrs.define
class HeldScorer:
    """Each teacher call waits until `finish(teacher, fail=...)`, then scores its batch for real
    (`score_teacher_batch`: padding to the teacher's DP size, shards, checked output) on the
    teacher, or on a failing wrapper of it. Two calls at once on one teacher are recorded in
    `overlaps` (and fail)."""

    bank: TeacherBank
    verifier: bool = False
    """It also serves the `VERIFIER` stage, whose calls write `reward_of` each row."""
    event: Callable[[], _Event] = trio.Event
    now: Callable[[], float] = trio.current_time
    """The run's clock (an asyncio part reads the machine's `MockClock` directly)."""
    reads: ClassVar[frozenset[str]] = TEACHER_INPUTS
    pending: dict[str, tuple[_Held, ScoreRequest]] = attrs.field(factory=dict)
    overlaps: list[str] = attrs.field(factory=list)
    calling: set[str] = attrs.field(factory=set)
    """Served teachers whose released call is still on the wire (the machine waits for them
    to end before its next event)."""

    @property
    def teachers(self) -> frozenset[str]:
        return frozenset(self.bank.teachers) | ({VERIFIER} if self.verifier else set())

    async def score(self, request: ScoreRequest) -> None:
        if request.teacher in self.pending:
            self.overlaps.append(request.teacher)
            raise AssertionError(f"two calls at once on teacher {request.teacher!r}")
        held = _Held(self.event(), started=self.now())
        self.pending[request.teacher] = (held, request)
        try:
            await held.done.wait()
        finally:
            if self.pending.get(request.teacher, (None,))[0] is held:
                del self.pending[request.teacher]
        if request.teacher == VERIFIER:
            if held.fail is not None:
                raise VERIFIER_FAILURES[held.fail](
                    f"verifier call failed ({held.fail}, by the machine)"
                )
            rows = request.store.get(request.sample_ids, ["input_ids"])
            request.store.add_fields(
                {sid: {request.field: reward_of(row["input_ids"])} for sid, row in rows.items()}
            )
            return
        if self.bank.served is not None:
            if held.fail == "raises":
                raise OSError("served teacher call failed (by the machine)")
            if held.fail is not None:
                raise TeacherOutputError("served teacher answered garbage (by the machine)")
            self.calling.add(request.teacher)
            try:
                await self.bank.served.score(request)
            finally:
                self.calling.discard(request.teacher)
            return
        teacher = self.bank.teachers[request.teacher]
        if held.fail is not None:
            teacher = FAILURES[held.fail](teacher)
        score_request(teacher, request)

    def finish(self, teacher: str, *, fail: str | None) -> ScoreRequest:
        held, request = self.pending[teacher]
        held.fail = fail
        held.done.set()
        return request


@attrs.define
class CheckingLearner:
    """Records each batch, and checks every row's teacher log-probs against what the row's
    teacher gives it alone (`TeacherBank.reference`): `wrong` lists the rows that differ."""

    bank: TeacherBank
    teacher_of: Callable[[int], str]
    verifier: bool = False
    """Rows must carry the verifier's `reward_of` them too."""
    batches: list[TrainBatch] = attrs.field(factory=list)
    wrong: list[str] = attrs.field(factory=list)
    steps: int = 0

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        self.batches.append(batch)
        self.steps += 1
        for group in batch.groups:
            assert group.ordinal is not None
            teacher = self.teacher_of(group.ordinal)
            for sid in group.sample_ids:
                row = batch.rows[sid]
                token_row = TokenRow(tuple(row["input_ids"]), int(row["prompt_length"]))
                want = self.bank.reference(teacher, token_row)
                got = list(row[TEACHER_FIELD])
                if len(got) != len(want) or any(
                    abs(g - w) > self.bank.tolerance for g, w in zip(got, want, strict=True)
                ):
                    self.wrong.append(f"{sid} (teacher {teacher}): wrote {got}, expected {want}")
                if self.verifier and row.get(REWARD_FIELD) != reward_of(row["input_ids"]):
                    self.wrong.append(
                        f"{sid} (verifier): reward {row.get(REWARD_FIELD)!r}, expected "
                        f"{reward_of(row['input_ids'])}"
                    )
        return {"groups": float(len(batch.groups))}

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps = state["steps"]


class AsyncioCheckingLearner(CheckingLearner):
    """A `CheckingLearner` whose state is saved and restored by `async def` methods on
    asyncio, as a learner's whose weights live in actors (an asyncio part)."""

    async def state_dict(self) -> dict[str, int]:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().state_dict()

    async def load_state_dict(self, state: Mapping[str, int]) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().load_state_dict(state)
