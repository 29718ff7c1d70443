"""Tests of `groupflow.impl.pipeline`: the pumps, the stages, configs, checkpoints, traces, failures."""
