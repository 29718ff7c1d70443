"""Tests of `groupflow.impl._trainer`: `groupflow train`'s config, run and teachers."""
