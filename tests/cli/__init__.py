"""Tests of `groupflow.impl.cli`: the command line."""
