"""Tests of `groupflow.sim`: the simulator, calibration, conformance and replay."""
