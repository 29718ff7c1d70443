"""Scoring a batch on a real teacher: the `Teacher` protocol, `score_teacher_batch` with DP
padding, and the adapter that lets the teacher stage call it (routing is in `_routing`).

A teacher runs data-parallel over `dp_size` ranks, so a batch is padded to a multiple of it with
temporary rows (copies of the last real row under ids no real row can have). They live in the
store only for the call, like the real rows the ranks read, and are cleared whatever happens.
"""

from __future__ import annotations

import math
import typing
import uuid
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import attrs

from groupflow.impl._core import PAD_PREFIX, SampleStore
from groupflow.impl.contract import TEACHER_FIELD, ScoreRequest, Teacher, TokenRow
from groupflow.model.errors import ArgumentError, RoutingError, TeacherOutputError

TEACHER_INPUTS = frozenset({"input_ids", "prompt_length"})
"""The row fields a teacher scores from: what the generator must write for it."""
LOGPROB_ROUNDING = 1e-4
"""How far above 0 a log-prob may be from rounding alone (a softmax's top entry in float32):
beyond it, a value is not a log-probability."""


@attrs.frozen
class BatchMeta:
    """The rows of a batch and the fields they have."""

    sample_ids: tuple[str, ...]
    fields: frozenset[str] = frozenset()

    def with_field(self, field: str) -> BatchMeta:
        return attrs.evolve(self, fields=self.fields | {field})


def _token_row(sample_id: str, fields: Mapping[str, Any]) -> TokenRow:
    ids = tuple(int(t) for t in fields["input_ids"])
    prompt = int(fields["prompt_length"])
    if not 1 <= prompt < len(ids):
        raise ArgumentError(
            f"row {sample_id!r}: prompt_length={prompt} must be >= 1 and < len(input_ids)={len(ids)}"
        )
    return TokenRow(ids, prompt)


def _label(sample_id: str, copies: str) -> str:
    """How an error names a row: a padding row by the real row it copies."""
    if sample_id.startswith(PAD_PREFIX):
        return f"a padding row (copy of {copies!r})"
    return repr(sample_id)


def check_teacher_output(
    ids: Sequence[str], rows: Sequence[TokenRow], scored: Sequence[Sequence[float]]
) -> list[list[float]]:
    """`scored` (one list of log-probs per row of `rows`, named by `ids`) as floats, or a
    `TeacherOutputError` naming the rows of the wrong length, not finite, or above 0."""
    copies = next((sid for sid in reversed(ids) if not sid.startswith(PAD_PREFIX)), "")
    if len(scored) != len(rows):
        raise TeacherOutputError(
            f"teacher returned {len(scored)} rows for {len(rows)}: rows "
            f"{[_label(sid, copies) for sid in ids]}"
        )
    out = []
    wrong_length, not_finite, above_zero = [], [], []
    for sid, row, values in zip(ids, rows, scored, strict=True):
        values = [float(v) for v in values]
        if len(values) != row.response_length:
            wrong_length.append(
                f"{_label(sid, copies)} ({len(values)} values, {row.response_length} tokens)"
            )
        elif not all(math.isfinite(v) for v in values):
            not_finite.append(_label(sid, copies))
        elif any(v > LOGPROB_ROUNDING for v in values):
            above_zero.append(f"{_label(sid, copies)} ({max(values)})")
        out.append(values)
    if wrong_length:
        raise TeacherOutputError(
            f"teacher returned the wrong length for rows {', '.join(wrong_length)}"
        )
    if not_finite:
        raise TeacherOutputError(
            f"teacher returned non-finite log-probs for rows {', '.join(not_finite)}"
        )
    if above_zero:
        raise TeacherOutputError(
            f"teacher returned log-probs above 0 (positive: not a probability) for rows "
            f"{', '.join(above_zero)}"
        )
    return out


def score_teacher_batch(
    store: SampleStore, teacher: Teacher, meta: BatchMeta, *, field: str = TEACHER_FIELD
) -> BatchMeta:
    """Score the rows of `meta` on `teacher` and write `field` for each; returns the new meta.

    Pads to a multiple of `teacher.dp_size`, splits into one shard per rank, validates what
    comes back, and writes the field for the real rows only, all at once: a failure leaves no
    partial field. The temporary rows are cleared on success and on failure; if clearing fails
    too, both errors are raised together.
    """
    steps = teacher_batch_steps(store, teacher, meta, field=field)
    try:
        shards = next(steps)
        try:
            results = teacher.score_shards(shards)
        except BaseException as error:
            steps.throw(error)  # clears the padding rows, and raises it again
            raise
        steps.send(results)
    except StopIteration as done:
        return typing.cast(BatchMeta, done.value)
    raise AssertionError("teacher_batch_steps yields once")


TeacherBatchSteps = Generator[
    Sequence[Sequence[TokenRow]], Sequence[Sequence[Sequence[float]]], BatchMeta
]
"""`score_teacher_batch` without the call: it yields the shards, is sent what the teacher
returned (or thrown what it raised), and returns the new meta. The blocking and the asyncio
scorers (`groupflow.impl.aio.teacher_scorer`) drive the same steps."""


def teacher_batch_steps(
    store: SampleStore, teacher: Teacher, meta: BatchMeta, *, field: str = TEACHER_FIELD
) -> TeacherBatchSteps:
    real = list(meta.sample_ids)
    if not real:
        # nothing to score: the caller's first `next` ends here, with no call made
        return meta.with_field(field)
    dp = teacher.dp_size
    pads = [f"{PAD_PREFIX}{uuid.uuid4().hex}" for _ in range(-len(real) % dp)]
    fields = store.get(real, sorted(TEACHER_INPUTS))
    try:
        if pads:  # inside the try: a put that fails part-way leaves rows to clear as well
            store.put({pad: dict(fields[real[-1]]) for pad in pads})
        ids = real + pads
        rows = [_token_row(sid, fields[real[-1]] if sid in pads else fields[sid]) for sid in ids]
        per_rank = len(ids) // dp
        shards = [rows[r * per_rank : (r + 1) * per_rank] for r in range(dp)]
        results = yield shards
        if len(results) != dp:
            raise TeacherOutputError(f"teacher returned {len(results)} shards for dp_size={dp}")
        uneven = [r for r in range(dp) if len(results[r]) != len(shards[r])]
        if uneven:
            raise TeacherOutputError(
                f"teacher returned the wrong number of rows for shards {uneven} "
                f"({[len(results[r]) for r in uneven]} for {per_rank} each)"
            )
        scored = check_teacher_output(ids, rows, [row for shard in results for row in shard])
    except BaseException as error:
        _clear_pads(store, pads, error)
        raise
    _clear_pads(store, pads, None)
    _write_scores(store, real, scored, field)
    return meta.with_field(field)


def _write_scores(
    store: SampleStore, real: list[str], scored: list[list[float]], field: str
) -> None:
    """Write the real rows' log-probs, all at once; the padding rows come after them in
    `scored`, and their values are dropped."""
    store.add_fields({sid: {field: v} for sid, v in zip(real, scored[: len(real)], strict=True)})


def _clear_pads(store: SampleStore, pads: list[str], error: BaseException | None) -> None:
    if not pads:
        return
    try:
        store.clear(pads, missing_ok=True)
    except Exception as cleanup:
        if error is None:
            raise
        raise BaseExceptionGroup(
            "scoring failed and clearing its temporary rows failed too", [error, cleanup]
        ) from None


def score_request(teacher: Teacher, request: ScoreRequest) -> None:
    """`score_teacher_batch` for the rows and field of a stage's request (blocking)."""
    score_teacher_batch(request.store, teacher, BatchMeta(request.sample_ids), field=request.field)


@attrs.frozen
class TeacherScorer:
    """The blocking scorer the teacher stage runs in a worker thread (wrap it in
    `ThreadedScorer`): one `score_teacher_batch` on the request's physical teacher."""

    teachers: Mapping[str, Teacher]
    """The physical teachers by name: the names routes may lead to."""
    reads = TEACHER_INPUTS

    def __call__(self, request: ScoreRequest) -> None:
        score_request(physical_teacher(self.teachers, request), request)


T = typing.TypeVar("T")


def physical_teacher(teachers: Mapping[str, T], request: ScoreRequest) -> T:
    """The teacher `request` names, or `RoutingError` naming the ones there are."""
    teacher = teachers.get(request.teacher)
    if teacher is None:
        raise RoutingError(f"no physical teacher {request.teacher!r}; have {sorted(teachers)}")
    return teacher
