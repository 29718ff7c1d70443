"""`ValueEnum`: the base of the enums whose members print as their value and hash by identity."""

from __future__ import annotations

import enum


class ValueEnum(enum.Enum):
    """An enum whose `str` is its value (the name users see in messages, tables and diagrams).

    Members are singletons, so identity hashing is exact, and much cheaper than Enum's
    name-based `__hash__` where members are hashed by the million (the exhaustive explorer
    hashes group states, events and actors in every state it visits).
    """

    def __str__(self) -> str:
        return str(self.value)

    __hash__ = object.__hash__
