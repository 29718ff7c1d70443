"""Internal: where rows live (`SampleStore`, `MemoryStore`), the `ReplayBuffer` whose every
group change goes through the lifecycle model, its `BufferConfig`, the `PromptLedger` that knows
what became of every prompt, `ray_session`, the validators every config shares, and where
groupflow caches what it builds once (`default_cache_dir`).

Imports only `groupflow.model`: the pipeline, the teacher backends and the command line are built
on top of this, never the other way round. `TransferQueueStore` (`_tq_store`) needs the `tq` extra
and is imported by name where it is used; Ray is imported only when a session opens.
"""

from groupflow.impl._core._buffer import ReplayBuffer
from groupflow.impl._core._buffer_config import BufferConfig, Sampler
from groupflow.impl._core._buffer_state import STATE_DICT_FORMAT
from groupflow.impl._core._cache_dir import default_cache_dir
from groupflow.impl._core._deprecate import GroupflowDeprecationWarning, deprecated
from groupflow.impl._core._lazy import lazy_names
from groupflow.impl._core._ledger import PromptLedger
from groupflow.impl._core._pulse import Pulse
from groupflow.impl._core._ray_session import (
    RaySession,
    RaySettings,
    import_ray,
    keep_ray_local,
    ray_session,
)
from groupflow.impl._core._slot import Selection
from groupflow.impl._core._store import (
    PAD_PREFIX,
    Fields,
    MemoryStore,
    Row,
    SampleStore,
)
from groupflow.impl._core._validators import (
    MAX_RUN_PROMPTS,
    check_run_size,
    choice,
    positive_number,
    positive_seconds,
)
from groupflow.model.validators import non_negative_int, positive_int

__all__ = [
    "default_cache_dir",
    "GroupflowDeprecationWarning",
    "deprecated",
    "lazy_names",
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
