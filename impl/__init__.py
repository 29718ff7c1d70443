"""The trio implementation of groupflow: store, buffer, and (later) stages, pumps and CLI."""

from groupflow.impl.buffer import BufferFull, ReplayBuffer, Selection, UnknownGroup
from groupflow.impl.buffer_config import BufferConfig, Sampler
from groupflow.impl.store import DuplicateDataError, MemoryStore, MissingDataError, Row, SampleStore

__all__ = [
    "BufferConfig",
    "BufferFull",
    "DuplicateDataError",
    "MemoryStore",
    "MissingDataError",
    "ReplayBuffer",
    "Row",
    "SampleStore",
    "Sampler",
    "Selection",
    "UnknownGroup",
]
