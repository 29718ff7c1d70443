"""Tests of `groupflow.impl.engines`: served teachers and generators, the vLLM server."""
