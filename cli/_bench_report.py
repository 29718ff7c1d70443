"""What `groupflow bench-teacher` prints, for a teacher in this process or one on a vLLM
server: one call of every row against one call per group, and their ratio."""

from __future__ import annotations

import argparse
import json
from typing import Any


def report(
    args: argparse.Namespace,
    facts: dict[str, Any],
    title: str,
    t_batched: float,
    t_separate: float,
) -> int:
    """Print the two timings and their ratio (or, with `--json`, all of it as JSON)."""
    n = args.groups * args.rows_per_group
    result = {
        **facts,
        "groups": args.groups,
        "rows_per_group": args.rows_per_group,
        "seq_len": args.seq_len,
        "batched_s": t_batched,
        "separate_s": t_separate,
        "ratio_separate_over_batched": t_separate / t_batched,
        "rows_per_s_batched": n / t_batched,
        "rows_per_s_separate": n / t_separate,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{title}; {args.groups} groups x {args.rows_per_group} rows of {args.seq_len} tokens; "
        f"median of {args.repeats}"
    )
    print(
        f"  one call of {n} rows:       {t_batched * 1e3:10.1f} ms   {n / t_batched:10.1f} rows/s"
    )
    print(
        f"  {args.groups} calls of {args.rows_per_group} rows:     {t_separate * 1e3:10.1f} ms   "
        f"{n / t_separate:10.1f} rows/s"
    )
    print(
        f"  separate / batched: x{t_separate / t_batched:.2f} (x{args.groups} would be purely "
        f"latency-bound, x1 compute-bound)"
    )
    return 0
