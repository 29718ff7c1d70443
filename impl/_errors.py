"""Exception plumbing shared by the pumps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a nursery's ExceptionGroup of exactly one error as that error.

    A pump's internal nursery wraps the one failure that matters (a failed teacher call, say);
    unwrapped, callers and the supervisor can name it. Groups of several errors pass unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from group
        raise


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]
