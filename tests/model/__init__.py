"""Tests of `groupflow.model`: the lifecycle, invariants, decisions and the scheduler's checker."""
