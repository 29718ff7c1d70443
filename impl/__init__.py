"""The trio implementation of groupflow: store, buffer, pumps and their supervisor, CLI."""

from groupflow.impl.buffer import BufferFull, ReplayBuffer, Selection, UnknownGroup
from groupflow.impl.buffer_config import BufferConfig, Sampler
from groupflow.impl.pipeline_config import Dispatch, PipelineConfig, ScoringConfig, StallAction
from groupflow.impl.pump import Pump, PumpKind, StagePump
from groupflow.impl.store import DuplicateDataError, MemoryStore, MissingDataError, Row, SampleStore
from groupflow.impl.supervisor import MonitorReturned, PumpFailed, ShutdownTimeout, supervise

__all__ = [
    "BufferConfig",
    "BufferFull",
    "Dispatch",
    "DuplicateDataError",
    "MemoryStore",
    "MissingDataError",
    "MonitorReturned",
    "PipelineConfig",
    "Pump",
    "PumpFailed",
    "PumpKind",
    "ReplayBuffer",
    "Row",
    "SampleStore",
    "Sampler",
    "ScoringConfig",
    "Selection",
    "ShutdownTimeout",
    "StagePump",
    "StallAction",
    "UnknownGroup",
    "supervise",
]
