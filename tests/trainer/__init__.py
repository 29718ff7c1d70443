"""Tests of `groupflow.impl.trainer`: `groupflow train`'s config, run and teachers."""
