"""Tests of `groupflow.impl.teachers`: teacher batches, the torch and Ray teachers."""
