"""Tests of `groupflow.impl._teachers`: teacher batches, the torch and Ray teachers."""
