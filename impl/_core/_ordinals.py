"""`OrdinalSet`: a set of prompt ordinals that stays small while they come in order.

Training settles prompts roughly in order, so the set of settled ordinals is almost always
`0..n-1` plus a few above: it is kept as that low-water mark and the few, and a run of ten
thousand steps holds a handful of ints instead of tens of thousands.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSet


class OrdinalSet(MutableSet[int]):
    """Non-negative ints, stored as "every ordinal below `below`" plus the set `above`."""

    __slots__ = ("above", "below")

    def __init__(self, ordinals: Iterable[int] = ()) -> None:
        self.below = 0
        self.above: set[int] = set()
        for ordinal in ordinals:
            self.add(ordinal)

    def __contains__(self, ordinal: object) -> bool:
        if not isinstance(ordinal, int):
            return False
        return 0 <= ordinal < self.below or ordinal in self.above

    def __iter__(self) -> Iterator[int]:
        yield from range(self.below)
        yield from sorted(self.above)

    def __len__(self) -> int:
        return self.below + len(self.above)

    def add(self, ordinal: int) -> None:
        if ordinal < 0:
            raise ValueError(f"ordinals are >= 0, got {ordinal}")
        if ordinal < self.below:
            return
        if ordinal != self.below:
            self.above.add(ordinal)
            return
        self.below += 1
        while self.below in self.above:
            self.above.discard(self.below)
            self.below += 1

    def discard(self, ordinal: int) -> None:
        if 0 <= ordinal < self.below:  # rare: the run below it is split
            self.above.update(range(ordinal + 1, self.below))
            self.below = ordinal
        else:
            self.above.discard(ordinal)

    def __repr__(self) -> str:
        return f"OrdinalSet(below={self.below}, above={sorted(self.above)})"
