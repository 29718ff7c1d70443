"""What a user implements to bring their own parts, and what those parts are handed.

A generator (`Generator`), a learner (`Learner`, or `StatelessLearner` for one with no state to
checkpoint), a scorer for the teacher stage (`Scorer`), or a teacher scored in DP shards
(`Teacher`); and the values they receive: `GenerateRequest`, `TrainBatch`, `ScoreRequest`,
`TokenRow`, and `GroupView` (a group as a part sees it: in a `TrainBatch` or a `ScoreRequest`).
`TEACHER_FIELD` is the field the teacher stage writes and a distilling learner reads.
"""

from groupflow.impl.pipeline import (
    TEACHER_FIELD,
    GenerateRequest,
    Generator,
    Learner,
    Scorer,
    ScoreRequest,
    StatelessLearner,
    Teacher,
    TokenRow,
    TrainBatch,
)
from groupflow.model import GroupView

__all__ = [
    "TEACHER_FIELD",
    "GenerateRequest",
    "Generator",
    "GroupView",
    "Learner",
    "ScoreRequest",
    "Scorer",
    "StatelessLearner",
    "Teacher",
    "TokenRow",
    "TrainBatch",
]
