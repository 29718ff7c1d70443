"""Tests of `groupflow.sim.verify`: conformance of a live run, and the replay of its trace."""
