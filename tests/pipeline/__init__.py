"""Tests of `groupflow.impl._pipeline`: the pumps, the stages, configs, checkpoints, traces, failures."""
