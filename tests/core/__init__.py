"""Tests of `groupflow.impl._core`: the store, the replay buffer, the ledger."""
