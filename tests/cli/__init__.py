"""Tests of `groupflow.cli`: the command line."""
