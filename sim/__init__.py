"""Deterministic simulation of the trio implementation under virtual time (docs/simulator.md)."""
