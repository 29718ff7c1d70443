"""The core: where rows live (`SampleStore`, `MemoryStore`), the `ReplayBuffer` whose every group
change goes through the lifecycle model, its `BufferConfig`, and the `PromptLedger` that knows
what became of every prompt.

Imports only `groupflow.model`: the pipeline, the teacher backends and the command line are
built on top of this, never the other way round.
"""

from groupflow.impl.core._buffer import (
    STATE_DICT_FORMAT,
    BufferFull,
    BufferHandle,
    ReplayBuffer,
    Selection,
    UnknownGroup,
)
from groupflow.impl.core._buffer_config import BufferConfig, Sampler
from groupflow.impl.core._ledger import PromptLedger
from groupflow.impl.core._pulse import Pulse
from groupflow.impl.core._store import (
    DuplicateDataError,
    Fields,
    MemoryStore,
    MissingDataError,
    Row,
    SampleStore,
)
from groupflow.impl.core._validators import non_negative_int, positive_int, positive_seconds

__all__ = [
    "STATE_DICT_FORMAT",
    "BufferConfig",
    "BufferFull",
    "BufferHandle",
    "DuplicateDataError",
    "Fields",
    "MemoryStore",
    "MissingDataError",
    "PromptLedger",
    "Pulse",
    "ReplayBuffer",
    "Row",
    "SampleStore",
    "Sampler",
    "Selection",
    "UnknownGroup",
    "non_negative_int",
    "positive_int",
    "positive_seconds",
]
