"""The verifier of real runs: a live run checked against the scheduler's model action by
action (`conformance`), and a run's trace judged after the fact (`replay`, reading it with
`trace_reader`). It reads the model and the pipeline only; the simulator and the fuzzer use it
to check the runs they make (docs/conformance.md, docs/replay.md)."""
