"""The embedded task: short token sequences from two domains, each with one right answer.

`count` continues a run of consecutive numbers; `reverse` writes a sequence backwards. Every
prompt has the same length and every answer too, so a batch needs no padding, and an answer
is checked by comparing tokens (`Domain.correct`). The data is a pure function of the ordinal:
a resumed run, or a second process, sees the same prompt for the same ordinal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

TASK_VERSION = 2
"""Bump when a domain's prompts or answers change: cached teachers are keyed on it (and on a
digest of sample prompts, which catches a change nobody bumped this for)."""
VOCAB = 32
"""Token ids 0..31: 0 starts every sequence, 1 and 2 name the domain, 3..31 are items."""
BOS = 0
FIRST_ITEM = 3
ITEMS = VOCAB - FIRST_ITEM
PROMPT_ITEMS = 4
"""Items in a prompt (after BOS and the domain token)."""
ANSWER_LENGTH = 4
PROMPT_LENGTH = 2 + PROMPT_ITEMS
REVERSE_ITEMS = 10
"""`reverse` draws its items from the first ten: a student sampling at random then meets the
right token often enough for the teacher's signal to reach it early."""


@attrs.frozen
class Prompt:
    """One prompt: its ordinal, domain (the agent teachers are routed by) and tokens."""

    ordinal: int
    domain: str
    tokens: tuple[int, ...]
    answer: tuple[int, ...]


@attrs.frozen
class Domain:
    name: str
    token: int
    items: Callable[[int], tuple[int, ...]]
    """The prompt's items for a seed number (`Domain.prompt`)."""
    solve: Callable[[Sequence[int]], tuple[int, ...]]
    """The answer to a prompt's items."""

    def prompt(self, ordinal: int, number: int) -> Prompt:
        items = self.items(number)
        return Prompt(ordinal, self.name, (BOS, self.token, *items), self.solve(items))

    def correct(self, prompt: Prompt, response: Sequence[int]) -> bool:
        return tuple(response) == prompt.answer


def _count_items(number: int) -> tuple[int, ...]:
    start = FIRST_ITEM + number % (ITEMS - PROMPT_ITEMS - ANSWER_LENGTH + 1)
    return tuple(range(start, start + PROMPT_ITEMS))


def _count_solve(items: Sequence[int]) -> tuple[int, ...]:
    last = items[-1]
    return tuple(range(last + 1, last + 1 + ANSWER_LENGTH))


def _reverse_items(number: int) -> tuple[int, ...]:
    out, n = [], number
    for _ in range(PROMPT_ITEMS):
        n = (n * 1103515245 + 12345) % 2**31
        out.append(FIRST_ITEM + (n >> 16) % REVERSE_ITEMS)
    return tuple(out)


def _reverse_solve(items: Sequence[int]) -> tuple[int, ...]:
    return tuple(reversed(items))[:ANSWER_LENGTH]


DOMAINS: dict[str, Domain] = {
    "count": Domain("count", 1, _count_items, _count_solve),
    "reverse": Domain("reverse", 2, _reverse_items, _reverse_solve),
}
"""The embedded domains by name: each is an agent, with its own teacher."""


def token_words() -> tuple[str, ...]:
    """A word for each token id, for the tokenizer an inference engine wants beside a model:
    `<s>`, the domains' names, then `i3` ... `i31` for the items."""
    by_token = {d.token: d.name for d in DOMAINS.values()}
    return tuple("<s>" if t == BOS else by_token.get(t, f"i{t}") for t in range(VOCAB))


def make_prompts(n: int, *, domains: Sequence[str] = tuple(DOMAINS), seed: int = 0) -> list[Prompt]:
    """`n` prompts, ordinal `o` from domain `domains[o % len(domains)]`; the same `n`, domains
    and seed give the same prompts."""
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains:
        raise ValueError(f"domains {list(domains)}: each must be one of {sorted(DOMAINS)}")
    out = []
    for o in range(n):
        domain = DOMAINS[domains[o % len(domains)]]
        out.append(domain.prompt(o, seed * 7919 + o // len(domains)))
    return out


def domain_of(prompt: Prompt) -> Domain:
    return DOMAINS[prompt.domain]
