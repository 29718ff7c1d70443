"""Tests of `groupflow.impl.core`: the store, the replay buffer, the ledger."""
