"""Tests of the house itself: layers, docs, packaging, the public API, examples."""
