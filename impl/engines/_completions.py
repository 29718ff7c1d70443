"""The wire format of OpenAI-compatible completions servers (vLLM's `/v1/completions`): a
teacher call, which asks for the log-probability of every token of each row, and a rollout,
which samples a group of responses with their log-probs; and the checks of what comes back.
Pure functions over JSON values, no I/O: a server that speaks another dialect (SGLang's, say)
is another pair of functions here.

What comes back is checked for identity (the model asked for, the tokens sent, one choice per
row or sample) and for meaning: a log-prob is a finite number, at most 0, and not an engine's
clamp of minus infinity (vLLM writes -inf as -9999.0, so a check for finite numbers alone never
sees it). Anything else is `EngineOutputError` naming the engine, the row and the position.

A teacher scores the tokens of a row as its prompt: token-id prompts, `max_tokens: 1` (a
completion must generate something), `prompt_logprobs: 0` (the log-probability of each token
given the ones before it; the first has none) and `return_token_ids` (the server says which
tokens it read, so a tokenizer or a truncation that changed them is caught, not trained on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from groupflow.impl._teachers import LOGPROB_ROUNDING
from groupflow.impl.contract import TokenRow
from groupflow.model.errors import EngineOutputError

__all__ = [
    "COMPLETIONS",
    "check_logprob",
    "read_prompt_logprobs",
    "read_samples",
    "sample_body",
    "score_body",
]

COMPLETIONS = "/v1/completions"
CLAMP = -9999.0
"""vLLM's stand-in for a log-prob of minus infinity (JSON has no infinity): at or below it, a
log-prob is impossible to train on."""


def check_logprob(value: object, *, where: str, what: str) -> float:
    """`value` as a log-prob, or `EngineOutputError` naming `where` and `what` (the row and
    position): a number, finite, at most 0 (but for rounding), above the engine's clamp."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineOutputError(f"{where} returned no log-prob for {what}: {value!r:.40}")
    if not math.isfinite(value):
        raise EngineOutputError(f"{where} returned a non-finite log-prob ({value}) for {what}")
    if value > LOGPROB_ROUNDING:
        raise EngineOutputError(
            f"{where} returned a log-prob above 0 ({value}) for {what}: not a probability"
        )
    if value <= CLAMP:
        raise EngineOutputError(
            f"{where} returned the log-prob {value} for {what}: the engine's clamp of minus "
            f"infinity (a token the model gives no probability)"
        )
    return float(value)


def check_model(body: Mapping[str, Any], model: str, *, where: str) -> None:
    """The answer is the served `model`'s: a server behind a router or a name mix-up that
    answers for another model is refused, not trained on."""
    answered = body.get("model")
    if answered != model:
        raise EngineOutputError(
            f"{where} answered for model {answered!r:.120}, asked for {model!r}"
        )


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
    body: object, rows: Sequence[TokenRow], *, model: str, where: str
) -> list[list[float]]:
    """Each row's response-token log-probs from a server's answer, checked: the model asked
    for, one choice per row, the tokens the server read are the ones sent, and one log-prob
    (`check_logprob`) for each response token. `EngineOutputError` naming `where` (the server)
    and the row otherwise."""
    ordered = _choices(body, len(rows), model=model, where=where, unit="rows sent")
    return [
        _row_logprobs(c, row, i, where)
        for i, (c, row) in enumerate(zip(ordered, rows, strict=True))
    ]


def _row_logprobs(choice: Mapping[str, Any], row: TokenRow, index: int, where: str) -> list[float]:
    seen = choice.get("prompt_token_ids")
    if seen is not None and list(seen) != list(row.input_ids):
        raise EngineOutputError(
            f"{where} read other tokens for row {index} than were sent ({len(seen)} tokens, "
            f"{len(row.input_ids)} sent): a tokenizer or a truncation changed them"
        )
    logprobs = choice.get("prompt_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(row.input_ids):
        got = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
        raise EngineOutputError(
            f"{where} returned prompt_logprobs of {got} for row {index} of "
            f"{len(row.input_ids)} tokens"
        )
    out = []
    for position in range(row.prompt_length, len(row.input_ids)):
        token = row.input_ids[position]
        entry = logprobs[position]
        value = entry.get(str(token)) if isinstance(entry, Mapping) else None
        logprob = value.get("logprob") if isinstance(value, Mapping) else None
        what = f"token {token} at position {position} of row {index}"
        out.append(check_logprob(logprob, where=where, what=what))
    return out


def _choices(
    body: object, count: int, *, model: str, where: str, unit: str
) -> list[Mapping[str, Any]]:
    """The answer's `count` choices in `index` order, the answer checked to be `model`'s."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(body, Mapping) or not isinstance(choices, list):
        raise EngineOutputError(f"{where} answered without a list of choices: {_snippet(body)}")
    check_model(body, model, where=where)
    if len(choices) != count:
        raise EngineOutputError(f"{where} answered {len(choices)} choices for {count} {unit}")
    ordered: list[Mapping[str, Any] | None] = [None] * count
    for choice in choices:
        index = choice.get("index") if isinstance(choice, Mapping) else None
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < count
            or ordered[index] is not None
        ):
            raise EngineOutputError(f"{where} answered a choice with index {index!r}")
        ordered[index] = choice
    return [c for c in ordered if c is not None]


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
    body: object,
    prompt: Sequence[int],
    n: int,
    *,
    model: str,
    max_tokens: int,
    where: str,
    exact_length: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """Each sampled response's token ids and their log-probs, checked: the model asked for,
    `n` choices, the prompt the server read is the one sent, between 1 and `max_tokens`
    tokens (exactly `max_tokens` with `exact_length`), and one log-prob (`check_logprob`)
    per sampled token. `EngineOutputError` naming `where` otherwise."""
    out = []
    ordered = _choices(body, n, model=model, where=where, unit=f"samples (n={n})")
    for index, choice in enumerate(ordered):
        seen = choice.get("prompt_token_ids")
        if seen is not None and list(seen) != list(prompt):
            raise EngineOutputError(f"{where} read another prompt than was sent for sample {index}")
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, Mapping) else None
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise EngineOutputError(f"{where} returned no token ids for sample {index}")
        if len(ids) > max_tokens or (exact_length and len(ids) != max_tokens):
            asked = f"{max_tokens} asked for" if exact_length else f"at most {max_tokens} asked"
            raise EngineOutputError(
                f"{where} returned {len(ids)} tokens for sample {index}, {asked}"
            )
        if not isinstance(values, list) or len(values) != len(ids):
            raise EngineOutputError(
                f"{where} returned {len(values) if isinstance(values, list) else 'no'} log-probs "
                f"for the {len(ids)} tokens of sample {index}"
            )
        checked = [
            check_logprob(v, where=where, what=f"token {p} of sample {index}")
            for p, v in enumerate(values)
        ]
        out.append((list(ids), checked))
    return out
