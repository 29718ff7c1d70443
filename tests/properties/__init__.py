"""Tests of `groupflow.properties`: the state machines at CI budget, and their seeded bugs."""
