"""The fakes are in `groupflow.impl.testing`; this name for them still works, with a warning."""

import warnings as _warnings

import groupflow.impl.testing as _testing


def __getattr__(name: str) -> object:
    if name in _testing.__all__:
        _warnings.warn(
            f"groupflow.sim.fakes.{name} is in groupflow.impl.testing: "
            f"write `from groupflow.impl.testing import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_testing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
