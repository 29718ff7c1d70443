"""The buffer state machine at CI budget (`groupflow fuzz` runs it longer)."""

from groupflow.properties import run_buffer_machine


def test_buffer_machine_agrees_with_model() -> None:
    run_buffer_machine(max_examples=200, steps=50)
