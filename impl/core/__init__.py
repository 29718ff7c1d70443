"""The core: where rows live (`SampleStore`, `MemoryStore`, and `TransferQueueStore` beyond one
machine), the `ReplayBuffer` whose every group change goes through the lifecycle model, its
`BufferConfig`, the `PromptLedger` that knows what became of every prompt, and `ray_session`.

Imports only `groupflow.model`: the pipeline, the teacher backends and the command line are
built on top of this, never the other way round. `TransferQueueStore` needs the `tq` extra and
is imported on first use; Ray is imported only when a session opens.
"""

from typing import TYPE_CHECKING

from groupflow.impl.core._buffer import ReplayBuffer
from groupflow.impl.core._buffer_config import BufferConfig, Sampler
from groupflow.impl.core._buffer_state import STATE_DICT_FORMAT
from groupflow.impl.core._deprecate import GroupflowDeprecationWarning, deprecated
from groupflow.impl.core._lazy import lazy_names
from groupflow.impl.core._ledger import PromptLedger
from groupflow.impl.core._pulse import Pulse
from groupflow.impl.core._ray_session import (
    RaySession,
    RaySettings,
    import_ray,
    keep_ray_local,
    ray_session,
)
from groupflow.impl.core._slot import Selection
from groupflow.impl.core._store import (
    PAD_PREFIX,
    Fields,
    MemoryStore,
    Row,
    SampleStore,
)
from groupflow.impl.core._validators import (
    MAX_RUN_PROMPTS,
    check_run_size,
    choice,
    positive_number,
    positive_seconds,
)
from groupflow.model.validators import non_negative_int, positive_int

if TYPE_CHECKING:
    from groupflow.impl.core._tq_store import KEY_FIELD, TransferQueueStore

_LAZY = {
    "KEY_FIELD": "_tq_store",
    "TransferQueueStore": "_tq_store",
}
"""Names whose module needs the `tq` extra (TransferQueue, torch): loaded on first use."""

__getattr__ = lazy_names(__name__, _LAZY, globals())

__all__ = [
    "GroupflowDeprecationWarning",
    "deprecated",
    "lazy_names",
    "KEY_FIELD",
    "PAD_PREFIX",
    "STATE_DICT_FORMAT",
    "BufferConfig",
    "Fields",
    "MemoryStore",
    "PromptLedger",
    "Pulse",
    "RaySession",
    "RaySettings",
    "ReplayBuffer",
    "Row",
    "SampleStore",
    "Sampler",
    "Selection",
    "TransferQueueStore",
    "choice",
    "import_ray",
    "keep_ray_local",
    "non_negative_int",
    "MAX_RUN_PROMPTS",
    "check_run_size",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "ray_session",
]
