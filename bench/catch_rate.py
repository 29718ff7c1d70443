"""How strong the pipeline machine is: each seeded bug of the catalogue, caught or not at the CI
budget, and how short Hypothesis shrinks the example that shows it.

Run: `python bench/catch_rate.py [--scorer fake|torch] [--device cpu] [--host trio|asyncio]`
(a few minutes on two cores). `--host asyncio` runs the machine with asyncio parts hosted on an
asyncio loop, and adds the bridge's own seeded bugs (`groupflow.properties.aio_bugs`). For every bug in `groupflow.properties.pipeline_bugs.BUGS` it runs the pipeline machine
at the budget `tests/properties/test_pipeline_machine.py` uses for them, with shrinking on, and prints
whether the failure matched what the catalogue says the machine reports, the rules in the
shrunk example, and the seconds; then the catch rate and the median shrunk length. The
escape-hatch deadlock (`unsafe=True`) is measured the same way, on its own line.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from groupflow.properties import aio_bugs, pipeline_machine
from groupflow.properties.pipeline_bugs import BUGS, applied
from groupflow.properties.pipeline_machine import run_pipeline_machine

EXAMPLES = 300
STEPS = 60


UNSAFE_EXAMPLES = 1000


def _run(examples: int = EXAMPLES, **kw: object) -> tuple[str | None, int, float]:
    """The failure's message (None: passed), the shrunk example's rules, and the seconds."""
    began = time.perf_counter()
    try:
        run_pipeline_machine(max_examples=examples, steps=STEPS, derandomize=True, **kw)  # type: ignore[arg-type]
    except AssertionError as exc:
        return str(exc), len(pipeline_machine.last_example), time.perf_counter() - began
    except ExceptionGroup as group:  # Hypothesis found distinct failures: any may be the bug's
        messages = "\n".join(str(exc) for exc in group.exceptions)
        return messages, len(pipeline_machine.last_example), time.perf_counter() - began
    return None, 0, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scorer", choices=["fake", "torch"], default="fake")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", choices=list(pipeline_machine.HOSTS), default="trio")
    args = parser.parse_args()
    print(f"budget: {EXAMPLES} examples of up to {STEPS} steps, derandomized, shrinking on")
    print(f"teachers: {args.scorer} on {args.device}; host: {args.host}")
    bugs = {**BUGS, **(aio_bugs.BUGS if args.host != "trio" else {})}
    lengths, caught = [], 0
    width = max(map(len, bugs))
    for name in sorted(bugs):
        with applied(name, bugs) as bug:
            message, length, seconds = _run(scorer=args.scorer, device=args.device, host=args.host)
        hit = message is not None and re.search(bug.says, message) is not None
        caught += hit
        if hit:
            lengths.append(length)
        verdict = "caught" if hit else ("other failure" if message else "MISSED")
        print(f"{name:<{width}}  {verdict:<13} {length:>3} rules  {seconds:6.1f} s", flush=True)
    message, length, seconds = _run(UNSAFE_EXAMPLES, unsafe=True, host=args.host)
    verdict = "found" if message and "fair drain did not complete" in message else "MISSED"
    print(
        f"{'(escape hatch) deadlock without timer or demand':<{width}}  {verdict:<13} "
        f"{length:>3} rules  {seconds:6.1f} s"
    )
    print(
        f"caught {caught}/{len(bugs)}; median shrunk example {statistics.median(lengths):g} "
        f"rules (min {min(lengths)}, max {max(lengths)})"
    )


if __name__ == "__main__":
    main()
