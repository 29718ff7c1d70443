"""The core: where rows live (`SampleStore`, `MemoryStore`), the `ReplayBuffer` whose every group
change goes through the lifecycle model, its `BufferConfig`, and the `PromptLedger` that knows
what became of every prompt.

Imports only `groupflow.model`: the pipeline, the teacher backends and the command line are
built on top of this, never the other way round.
"""

from groupflow.impl.core._buffer import (
    STATE_DICT_FORMAT,
    BufferHandle,
    ReplayBuffer,
    Selection,
)
from groupflow.impl.core._buffer_config import BufferConfig, Sampler
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
from groupflow.impl.core._store import (
    PAD_PREFIX,
    Fields,
    MemoryStore,
    Row,
    SampleStore,
)
from groupflow.impl.core._validators import (
    choice,
    non_negative_int,
    positive_int,
    positive_seconds,
)

__all__ = [
    "lazy_names",
    "PAD_PREFIX",
    "STATE_DICT_FORMAT",
    "BufferConfig",
    "BufferHandle",
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
    "choice",
    "import_ray",
    "keep_ray_local",
    "non_negative_int",
    "positive_int",
    "positive_seconds",
    "ray_session",
]
