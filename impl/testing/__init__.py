"""Stand-ins for the parts a user brings and the engines they talk to, for tests.

`FakeGenerator`, `FakeScorer` and `FakeLearner` take virtual time: they let the real pumps run
under `trio.testing.MockClock`, so a test of a whole pipeline finishes in milliseconds and is
the same on every run. Each can log what it did to a shared `Trace` of `Span`s (the simulator
hashes it and draws the timeline from it); `FakeScorer` records its `Call`s.

`VLLMImitation` is a server on 127.0.0.1 that answers as vLLM does, over real HTTP, and fails
as real servers do when a test scripts it to (`Fault`): for testing what talks to served
engines, `ServedTeachers` and `ServedGenerator` included. It records which weight version
sampled every completion (`Served`). It needs httpx's HTTP/1.1 library, h11 (the `served`
extra).
"""

from groupflow.impl.testing._fakes import Call, FakeGenerator, FakeLearner, FakeScorer, Span, Trace
from groupflow.impl.testing._vllm_imitation import Fault, FaultKind, Served, VLLMImitation

__all__ = [
    "Call",
    "FakeGenerator",
    "FakeLearner",
    "FakeScorer",
    "Fault",
    "FaultKind",
    "Served",
    "Span",
    "Trace",
    "VLLMImitation",
]
