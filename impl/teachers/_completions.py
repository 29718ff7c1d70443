"""The wire format of a teacher call to an OpenAI-compatible completions server (vLLM's
`/v1/completions`): the request that asks for the log-probability of every token of each row,
and the checks of what comes back. Pure functions over JSON values, no I/O: a server that
speaks another dialect (SGLang's, say) is another pair of functions here.

A teacher scores the tokens of a row as its prompt: token-id prompts, `max_tokens: 1` (a
completion must generate something), `prompt_logprobs: 0` (the log-probability of each token
given the ones before it; the first has none) and `return_token_ids` (the server says which
tokens it read, so a tokenizer or a truncation that changed them is caught, not trained on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from groupflow.impl.teachers._batch import TokenRow
from groupflow.model.errors import TeacherOutputError

__all__ = ["read_prompt_logprobs", "score_body"]


def score_body(model: str, rows: Sequence[TokenRow]) -> dict[str, Any]:
    """The JSON body of one request scoring `rows` on the served `model`."""
    return {
        "model": model,
        "prompt": [list(row.input_ids) for row in rows],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }


def read_prompt_logprobs(
    body: object, rows: Sequence[TokenRow], *, where: str
) -> list[list[float]]:
    """Each row's response-token log-probs from a server's answer, checked: one choice per
    row, the tokens the server read are the ones sent, and one finite log-prob for each
    response token. `TeacherOutputError` naming `where` (the server) and the row otherwise."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list):
        raise TeacherOutputError(f"{where} answered without a list of choices: {_snippet(body)}")
    if len(choices) != len(rows):
        raise TeacherOutputError(
            f"{where} answered {len(choices)} choices for {len(rows)} rows sent"
        )
    ordered: list[Mapping[str, Any] | None] = [None] * len(rows)
    for choice in choices:
        index = choice.get("index") if isinstance(choice, Mapping) else None
        if not isinstance(index, int) or not 0 <= index < len(rows) or ordered[index] is not None:
            raise TeacherOutputError(f"{where} answered a choice with index {index!r}")
        ordered[index] = choice
    return [
        _row_logprobs(c, row, i, where)
        for i, (c, row) in enumerate(zip(ordered, rows, strict=True))
    ]


def _row_logprobs(
    choice: Mapping[str, Any] | None, row: TokenRow, index: int, where: str
) -> list[float]:
    assert choice is not None
    seen = choice.get("prompt_token_ids")
    if seen is not None and list(seen) != list(row.input_ids):
        raise TeacherOutputError(
            f"{where} read other tokens for row {index} than were sent ({len(seen)} tokens, "
            f"{len(row.input_ids)} sent): a tokenizer or a truncation changed them"
        )
    logprobs = choice.get("prompt_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(row.input_ids):
        got = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
        raise TeacherOutputError(
            f"{where} returned prompt_logprobs of {got} for row {index} of "
            f"{len(row.input_ids)} tokens"
        )
    out = []
    for position in range(row.prompt_length, len(row.input_ids)):
        token = row.input_ids[position]
        entry = logprobs[position]
        value = entry.get(str(token)) if isinstance(entry, Mapping) else None
        logprob = value.get("logprob") if isinstance(value, Mapping) else None
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            raise TeacherOutputError(
                f"{where} returned no log-prob for token {token} at position {position} of "
                f"row {index}"
            )
        if not math.isfinite(logprob):
            raise TeacherOutputError(
                f"{where} returned a non-finite log-prob ({logprob}) at position {position} "
                f"of row {index}"
            )
        out.append(float(logprob))
    return out


def _snippet(value: object, most: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."
