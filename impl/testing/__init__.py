"""Fakes of the parts a user brings, for tests: they take virtual time.

`FakeGenerator`, `FakeScorer` and `FakeLearner` let the real pumps run under
`trio.testing.MockClock`, so a test of a whole pipeline finishes in milliseconds and is the same
on every run. Each can log what it did to a shared `Trace` of `Span`s (the simulator hashes it
and draws the timeline from it); `FakeScorer` records its `Call`s.
"""

from groupflow.impl.testing._fakes import Call, FakeGenerator, FakeLearner, FakeScorer, Span, Trace

__all__ = ["Call", "FakeGenerator", "FakeLearner", "FakeScorer", "Span", "Trace"]
