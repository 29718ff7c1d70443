"""The wire format of OpenAI-compatible completions servers (vLLM's `/v1/completions`): a
teacher call, which asks for the log-probability of every token of each row, and a rollout,
which samples a group of responses with their log-probs; and the checks of what comes back. Pure functions over JSON values, no I/O: a server that
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

from groupflow.impl.pipeline import TokenRow
from groupflow.model.errors import GeneratorOutputError, TeacherOutputError

__all__ = ["COMPLETIONS", "read_prompt_logprobs", "read_samples", "sample_body", "score_body"]

COMPLETIONS = "/v1/completions"


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


def sample_body(
    model: str,
    prompt: Sequence[int],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    exact_length: bool = False,
) -> dict[str, Any]:
    """The JSON body of one request sampling `n` responses to the token-id `prompt`, with the
    log-prob of each sampled token and the token ids themselves (not text); with
    `exact_length`, each response `max_tokens` long (no stop at an end-of-sequence token)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if exact_length:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return body


def read_samples(
    body: object, prompt: Sequence[int], n: int, *, where: str, length: int | None = None
) -> list[tuple[list[int], list[float]]]:
    """Each sampled response's token ids and their log-probs, checked: `n` choices, the prompt
    the server read is the one sent, one finite log-prob per sampled token, and (`length`
    given) that many tokens per response. `GeneratorOutputError` naming `where` otherwise."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else _snippet(body)
        raise GeneratorOutputError(f"{where} answered {got} choices for n={n}")
    ordered: list[Mapping[str, Any] | None] = [None] * n
    for choice in choices:
        index = choice.get("index") if isinstance(choice, Mapping) else None
        if not isinstance(index, int) or not 0 <= index < n or ordered[index] is not None:
            raise GeneratorOutputError(f"{where} answered a choice with index {index!r}")
        ordered[index] = choice
    out = []
    for index, choice in enumerate(ordered):
        assert choice is not None
        seen = choice.get("prompt_token_ids")
        if seen is not None and list(seen) != list(prompt):
            raise GeneratorOutputError(
                f"{where} read another prompt than was sent for sample {index}"
            )
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, Mapping) else None
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise GeneratorOutputError(f"{where} returned no token ids for sample {index}")
        if length is not None and len(ids) != length:
            raise GeneratorOutputError(
                f"{where} returned {len(ids)} tokens for sample {index}, {length} asked for"
            )
        if not isinstance(values, list) or len(values) != len(ids):
            raise GeneratorOutputError(
                f"{where} returned {len(values) if isinstance(values, list) else 'no'} log-probs "
                f"for the {len(ids)} tokens of sample {index}"
            )
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in values
        ):
            raise GeneratorOutputError(
                f"{where} returned a log-prob that is not a finite number for sample {index}"
            )
        out.append((list(ids), [float(v) for v in values]))
    return out
