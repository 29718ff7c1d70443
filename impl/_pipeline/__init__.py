"""Internal: the pipeline. The pumps (rollout, teacher stage, train, stall watchdog, and the inline
baseline in place of the stage), their `supervise`, the controller that wires them
(`build_pipeline`), the configuration, checkpoints, the observer every action is reported
to, and the trace written beside it.

Imports `groupflow.model`, `groupflow.impl._core` and the contract only; the teacher backends and the command
line sit above it.
"""

from groupflow.impl._pipeline._build import build_pipeline
from groupflow.impl._pipeline._checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpoint,
    Checkpointer,
    load_checkpoint,
)
from groupflow.impl._pipeline._checkpoint_disk import fsync_path, step_folders
from groupflow.impl._pipeline._config import (
    CheckpointConfig,
    Dispatch,
    PipelineConfig,
    ScoringConfig,
    Shape,
    StallAction,
)
from groupflow.impl._pipeline._controller import Pipeline, RunResult
from groupflow.impl._pipeline._failures import DEFAULT_TRANSIENT_ERRORS, is_transient
from groupflow.impl._pipeline._fingerprint import digest_data
from groupflow.impl._pipeline._inline_baseline import InlineScoring
from groupflow.impl._pipeline._observe import ActionObserver, ActionRecorder, RunStatus, lanes_for
from groupflow.impl._pipeline._part_name import part_name
from groupflow.impl._pipeline._pump import Pump, PumpKind, StagePump, leaves, single_error
from groupflow.impl._pipeline._rollout import RolloutPump, TrainPosition
from groupflow.impl._pipeline._scorer import ThreadedScorer, call_scorer
from groupflow.impl._pipeline._scoring_stage import (
    ExtraStage,
    OnDiscard,
    QueueView,
    ScoringStage,
    StageMetrics,
)
from groupflow.impl._pipeline._supervisor import (
    supervise,
)
from groupflow.impl._pipeline._trace import (
    TRACE_FILE,
    TRACE_FORMAT,
    TraceWriter,
    config_from_json,
    config_to_json,
    pipeline_header,
    trace_path,
)
from groupflow.impl._pipeline._train import StepRecord, TrainPump
from groupflow.impl._pipeline._watchdog import StallWatchdog
from groupflow.model.policy import CheckpointPolicy, Design, FailurePolicy

__all__ = [
    "fsync_path",
    "step_folders",
    "CHECKPOINT_FORMAT",
    "DEFAULT_TRANSIENT_ERRORS",
    "TRACE_FILE",
    "TRACE_FORMAT",
    "ActionObserver",
    "ActionRecorder",
    "Checkpoint",
    "CheckpointConfig",
    "Checkpointer",
    "CheckpointPolicy",
    "Design",
    "Dispatch",
    "FailurePolicy",
    "ExtraStage",
    "InlineScoring",
    "OnDiscard",
    "Pipeline",
    "PipelineConfig",
    "Pump",
    "PumpKind",
    "QueueView",
    "RolloutPump",
    "RunResult",
    "RunStatus",
    "ScoringConfig",
    "StagePump",
    "StageMetrics",
    "StallAction",
    "StallWatchdog",
    "StepRecord",
    "ScoringStage",
    "Shape",
    "ThreadedScorer",
    "TraceWriter",
    "TrainPosition",
    "TrainPump",
    "build_pipeline",
    "call_scorer",
    "config_from_json",
    "config_to_json",
    "digest_data",
    "is_transient",
    "lanes_for",
    "leaves",
    "load_checkpoint",
    "part_name",
    "pipeline_header",
    "single_error",
    "supervise",
    "trace_path",
]
