"""The prompt ledger: every prompt carries a monotonic ordinal from the data source, and the
ledger knows what became of each, so that no prompt is lost or trained twice across a crash.

An issued ordinal ends trained, given up (a failed rollout or scoring: shortfall), or dropped
(cancelled at shutdown or lost to a crash: issued again). The ledger hands out re-issued ordinals
before fresh ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from typing import Any

import attrs

from groupflow.impl._core._ordinals import OrdinalSet
from groupflow.impl._core._pulse import Pulse
from groupflow.model.decisions import reissue_on_resume
from groupflow.model.errors import CheckpointMismatch, Exhausted, LedgerInconsistent


class _Trained(Set[int]):
    """The trained ordinals: settled and not given up (a view, never copied)."""

    def __init__(self, settled: OrdinalSet, shortfall: set[int]) -> None:
        self._settled = settled
        self._shortfall = shortfall

    def __contains__(self, ordinal: object) -> bool:
        return ordinal in self._settled and ordinal not in self._shortfall

    def __iter__(self) -> Iterator[int]:
        return (o for o in self._settled if o not in self._shortfall)

    def __len__(self) -> int:
        return len(self._settled) - len(self._shortfall)


@attrs.frozen
class _Accounted:
    """Settled, or saved with a checkpoint: what a resume does not issue again."""

    settled: OrdinalSet
    saved: Set[int]

    def __contains__(self, ordinal: object) -> bool:
        return ordinal in self.settled or ordinal in self.saved


@attrs.define
class PromptLedger:
    """Ordinals 0..`num_prompts`-1 (None: an endless source).

    Memory stays flat over a long run: settled ordinals are an `OrdinalSet` (a low-water mark
    and the few above it), and only the given-up ones are listed one by one."""

    num_prompts: int | None
    cursor: int = 0
    """The next fresh ordinal."""
    settled: OrdinalSet = attrs.field(factory=OrdinalSet)
    """Trained or given up."""
    shortfall: set[int] = attrs.field(factory=set)
    reissue: deque[int] = attrs.field(factory=deque)
    in_flight: set[int] = attrs.field(factory=set)
    """Issued and not yet trained, given up or dropped."""
    changed: Pulse = attrs.field(factory=Pulse, kw_only=True)
    """Notified when a prompt is settled; the controller shares the buffer's pulse here, so a
    pump waiting on the buffer also wakes when the ledger learns what became of a prompt."""
    on_settled: Callable[[str, Sequence[int]], None] | None = attrs.field(
        default=None, kw_only=True
    )
    """Told `("trained", ordinals)` or `("given_up", ordinals)` as prompts settle: the trace
    records what became of each prompt without diffing the ledger after every action."""
    revision: int = attrs.field(default=0, kw_only=True)
    """Bumped by every change, so a pump that waits can tell at once whether anything it
    reads here changed."""

    @property
    def trained(self) -> Set[int]:
        return _Trained(self.settled, self.shortfall)

    def peek(self) -> int | None:
        """The ordinal `issue` would hand out, if any."""
        if self.reissue:
            return self.reissue[0]
        if self.num_prompts is None or self.cursor < self.num_prompts:
            return self.cursor
        return None

    def issue(self) -> int:
        ordinal = self.peek()
        if ordinal is None:
            raise Exhausted(f"the data source is exhausted ({self.num_prompts} prompts issued)")
        if self.reissue:
            self.reissue.popleft()
        else:
            self.cursor += 1
        self.in_flight.add(ordinal)
        self.revision += 1
        return ordinal

    @property
    def exhausted(self) -> bool:
        return self.peek() is None

    def mark_trained(self, ordinals: set[int] | list[int] | tuple[int, ...]) -> None:
        twice = sorted(o for o in set(ordinals) if o in self.settled)
        if twice:
            raise LedgerInconsistent(
                f"prompts {twice} were already trained: the ledger is inconsistent"
            )
        self._settle(ordinals)
        for ordinal in ordinals:
            self.settled.add(ordinal)
        if self.on_settled is not None:
            self.on_settled("trained", tuple(ordinals))
        self.changed.notify()

    def mark_shortfall(self, ordinal: int) -> None:
        """Given up on (failed for good): accounted, not issued again."""
        self._settle([ordinal])
        self.settled.add(ordinal)
        self.shortfall.add(ordinal)
        if self.on_settled is not None:
            self.on_settled("given_up", (ordinal,))
        self.changed.notify()

    def mark_dropped(self, ordinal: int) -> None:
        """Dropped without fault (shutdown, crash): issued again, first."""
        self._settle([ordinal])
        self.reissue.append(ordinal)
        self.changed.notify()

    def state_dict(self, *, saved: set[int]) -> dict[str, Any]:
        """The ledger as a checkpoint records it: `saved` are the ordinals whose READY groups the
        checkpoint holds; every other prompt in flight is to be issued again on resume."""
        unknown = sorted(saved - self.in_flight)
        if unknown:
            raise LedgerInconsistent(
                f"saved prompts {unknown} are not in flight: the ledger is inconsistent"
            )
        reissue = reissue_on_resume(self.cursor, _Accounted(self.settled, saved))
        # a list, not a set: a prompt both in flight and queued to issue again shows twice
        expected = sorted([*(self.in_flight - saved), *self.reissue])
        if list(reissue) != expected:
            raise LedgerInconsistent(
                f"the ledger is inconsistent: prompts to issue again {list(reissue)} by the "
                f"cursor, {expected} by what is in flight"
            )
        return {
            "num_prompts": self.num_prompts,
            "cursor": self.cursor,
            "trained": sorted(self.trained),
            "shortfall": sorted(self.shortfall),
            "saved": sorted(saved),
            "reissue": list(reissue),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Become the ledger a resumed run starts from: saved prompts are in flight (their READY
        groups are restored), the rest of what was in flight is issued again, first."""
        if state["num_prompts"] != self.num_prompts:
            raise CheckpointMismatch(
                f"checkpoint ledger covers {state['num_prompts']} prompts, this run has "
                f"{self.num_prompts}"
            )
        self.cursor = state["cursor"]
        self.settled = OrdinalSet([*state["trained"], *state["shortfall"]])
        self.shortfall = set(state["shortfall"])
        self.reissue = deque(state["reissue"])
        self.in_flight = set(state["saved"])
        self.revision += 1

    def _settle(self, ordinals: set[int] | list[int] | tuple[int, ...]) -> None:
        unknown = sorted(set(ordinals) - self.in_flight)
        if unknown:
            raise LedgerInconsistent(
                f"prompts {unknown} are not in flight: the ledger is inconsistent"
            )
        self.in_flight.difference_update(ordinals)
        self.revision += 1
