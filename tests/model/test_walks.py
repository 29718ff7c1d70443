"""Random walks through the scheduler model at CI budget (`groupflow fuzz` runs them longer)."""

from groupflow.properties import run_scheduler_walks


def test_random_walks_keep_every_invariant() -> None:
    run_scheduler_walks(max_examples=300, steps=100)
