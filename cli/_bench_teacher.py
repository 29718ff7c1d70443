"""`groupflow bench-teacher`: one batched teacher call against one call per group, same rows.

The ratio separate/batched decides whether batching across groups pays on a teacher: near the
number of groups, the teacher is latency-bound and the pump's batching is worth it; near 1, it is
compute-bound and batching buys little.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from groupflow.cli._args import at_least, executable_file, positive, with_defaults
from groupflow.cli._bench_report import report
from groupflow.cli._command import Command
from groupflow.model.errors import ArgumentError


def _median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_DEFAULTS: dict[str, object] = {
    "model": "tiny",
    "dp": 4,
    "device": "auto",
    "dtype": "float32",
    "vocab": 256,
}
"""The flags that only mean something for one engine or one way of serving, by default."""


def _unused(args: argparse.Namespace) -> str | None:
    """A flag given where it means nothing (the other engine's, or a server's to start with
    `--url` given), named with what to do; None where there is none."""
    if args.engine != "vllm":
        for flag, value in (("--url", args.url), ("--vllm-python", args.vllm_python)):
            if value is not None:
                return f"{flag} times a served teacher: add --engine vllm"
        if args.vocab is not None:
            return f"--vocab {args.vocab} sets a served teacher's token ids: add --engine vllm"
        return None
    for flag, value in (("--dp", args.dp), ("--device", args.device), ("--dtype", args.dtype)):
        if value is not None:
            return (
                f"{flag} {value} places a teacher in this process; a served teacher's server "
                f"places its own: drop it, or use --engine torch"
            )
    if args.url is not None:
        for flag, value in (("--model", args.model), ("--vllm-python", args.vllm_python)):
            if value is not None:
                return (
                    f"{flag} {value} is for a server started here; --url {args.url} times one "
                    f"running: drop one of them"
                )
    return None


def run(args: argparse.Namespace) -> int:
    unused = _unused(args)
    if unused is not None:
        raise ArgumentError(unused)
    args = with_defaults(args, _DEFAULTS)
    if args.engine == "vllm":
        from groupflow.cli import _bench_served

        return _bench_served.run(args)
    try:
        import torch

        from groupflow.impl._teachers import BatchMeta, score_teacher_batch, stored_groups
        from groupflow.impl._teachers._torch import PRESETS, TorchTeacher, random_rows
    except ImportError:
        print(
            "groupflow bench-teacher needs torch: pip install 'groupflow[torch]'", file=sys.stderr
        )
        return 2
    dtype = getattr(torch, args.dtype)
    kwargs: dict[str, Any] = {"dp_size": args.dp, "device": args.device, "dtype": dtype}
    if args.model in PRESETS:
        teacher = TorchTeacher.from_config(PRESETS[args.model], seed=0, **kwargs)
    elif not Path(args.model).is_file():
        raise ArgumentError(
            f"--model {args.model!r}: neither a preset ({', '.join(PRESETS)}) nor a file saved "
            f"by TorchTeacher.save"
        )
    else:  # CheckpointCorrupt: one line, exit status 2
        teacher = TorchTeacher.load(Path(args.model), **kwargs)
    cfg = teacher.model.cfg
    if args.seq_len > cfg.max_len:
        print(
            f"groupflow bench-teacher: --seq-len {args.seq_len} > the model's max_len {cfg.max_len}",
            file=sys.stderr,
        )
        return 2
    n = args.groups * args.rows_per_group
    rows = random_rows(
        n, length=args.seq_len, prompt=args.seq_len // 4, vocab=cfg.vocab_size, seed=1
    )
    store, views = stored_groups(rows, args.rows_per_group)
    ids = [sid for view in views for sid in view.sample_ids]
    field = iter(range(1_000_000))

    def call(subset: list[str]) -> None:
        score_teacher_batch(store, teacher, BatchMeta(tuple(subset)), field=f"t{next(field)}")

    def batched() -> None:
        call(ids)

    def separate() -> None:
        for g in range(args.groups):
            call(ids[g * args.rows_per_group : (g + 1) * args.rows_per_group])

    def sync() -> None:
        if teacher.device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():  # for this block only: a global switch would outlive the command
        batched()
        separate()  # warm-up
        t_batched = _median_seconds(batched, args.repeats, sync)
        t_separate = _median_seconds(separate, args.repeats, sync)
    facts = {
        "model": args.model,
        "parameters": teacher.num_parameters,
        "device": str(teacher.device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "dp": args.dp,
    }
    title = (
        f"teacher {args.model} ({teacher.num_parameters:,} parameters) on {teacher.device}, "
        f"{args.dtype}, DP {args.dp}, {torch.get_num_threads()} threads"
    )
    return report(args, facts, title, t_batched, t_separate)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="tiny, small, qwen3-1.7b-shape (for a GPU), or the path of a saved TorchTeacher "
        f"(default {_DEFAULTS['model']})",
    )
    p.add_argument("--groups", type=positive, default=8)
    p.add_argument("--rows-per-group", type=positive, default=4)
    p.add_argument("--seq-len", type=at_least(2), default=256, help="tokens per row (>= 2)")
    p.add_argument(
        "--dp", type=positive, default=None, help=f"DP ranks (default {_DEFAULTS['dp']})"
    )
    p.add_argument(
        "--device", default=None, help=f"auto, cpu or cuda (default {_DEFAULTS['device']})"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help=f"default {_DEFAULTS['dtype']}",
    )
    p.add_argument("--repeats", type=positive, default=7)
    p.add_argument("--json", action="store_true")
    served = p.add_argument_group("a served teacher (extra vllm)")
    served.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="torch: the teacher in this process (default); vllm: a served teacher, at --url "
        "or on a vLLM server started for --model (a preset's shape, or a Hugging Face folder)",
    )
    served.add_argument(
        "--url", default=None, metavar="URL", help="with --engine vllm: the server to time"
    )
    served.add_argument(
        "--vllm-python",
        type=executable_file,
        default=None,
        metavar="PYTHON",
        help="with --engine vllm and no --url: the interpreter that has vLLM",
    )
    served.add_argument(
        "--vocab",
        type=positive,
        default=None,
        help=f"with --url: the random rows' token ids are below this (default "
        f"{_DEFAULTS['vocab']})",
    )


COMMAND = Command(
    name="bench-teacher",
    help="time one batched teacher call against one call per group",
    description=__doc__ or "",
    arguments=_arguments,
    run=run,
)
