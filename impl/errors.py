"""Every error groupflow raises on purpose, in one place, by who caused it.

Import them from here: `from groupflow.impl.errors import CheckpointCorrupt, Stalled`. The
hierarchy (`GroupflowError` at the root; `UsageError`, `ExternalError`, `BackpressureError`,
`InternalError` below it; each class also under its nearest builtin) is described in
docs/failures.md. A traceback names each class by this module.
"""

from groupflow.model import errors as _model
from groupflow.model.errors import *  # noqa: F403 (each name once: model.errors' __all__)

__all__ = list(_model.__all__)


def _name_this_module() -> None:
    """Tracebacks and reprs say `groupflow.impl.errors.Stalled`, the name a user imports, not
    the module that defines it (the model raises them too, and imports nothing above it)."""
    for name in __all__:
        getattr(_model, name).__module__ = __name__


_name_this_module()
