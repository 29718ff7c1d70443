"""The one way a public name is deprecated: a warning that says what to use instead and the
release the name goes away in, so a deprecation cannot outlive its promise unnoticed."""

from __future__ import annotations

import warnings


class GroupflowDeprecationWarning(DeprecationWarning):
    """A groupflow name or behaviour that goes away in a named release."""


def deprecated(what: str, *, removed_in: str, instead: str, stacklevel: int = 2) -> None:
    """Warn that `what` goes away in release `removed_in`, and to use `instead`. Each call
    site is listed in CHANGELOG.md under the release that deprecates it;
    `tests/meta/test_packaging.py` fails once the package's version reaches `removed_in` while a
    call remains."""
    warnings.warn(
        f"{what} is deprecated and goes away in groupflow {removed_in}: use {instead}",
        GroupflowDeprecationWarning,
        stacklevel=stacklevel + 1,
    )
