"""Deterministic simulation of the trio implementation under virtual time (see DESIGN.md, "Simulation")."""
