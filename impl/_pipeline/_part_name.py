"""What errors call a user's part."""

from __future__ import annotations


def part_name(part: object) -> str:
    """What errors call a user's part: its class's name (the wrapped part's, for a wrapper
    that says what it wraps in `__wrapped__`, as `groupflow.impl.aio.part` does)."""
    return type(getattr(part, "__wrapped__", part)).__name__
