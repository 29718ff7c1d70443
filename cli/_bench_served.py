"""`groupflow bench-teacher --engine vllm`: the same question as the torch bench (one call of
groups x rows against one call per group) asked of a served teacher, through `ServedTeachers`,
the scorer the pipeline calls: at `--url`, or on a vLLM server started here for `--model` (a
Hugging Face folder, or a preset's shape in the Llama architecture with random weights)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from groupflow.model.errors import ArgumentError

CALL_TIMEOUT_S = 300.0
"""The most one timed call may take (the first is the server's warm-up)."""


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    """(URL, what it serves, its vocabulary) of the teacher to time: `--url`, or a server
    started here (and stopped after) for `--model`."""
    from groupflow.impl.engines import VLLMServer, is_url

    if args.url is not None:
        if not is_url(args.url):
            raise ArgumentError(f"--url {args.url!r}: not an http:// or https:// URL")
        yield args.url, args.url, args.vocab
        return
    from groupflow.impl._teachers._served_lm import LlamaLM, LlamaLMConfig
    from groupflow.impl._teachers._torch import PRESETS, new_lm

    with tempfile.TemporaryDirectory(prefix="groupflow-bench-") as tmp:
        if args.model in PRESETS:
            shape = PRESETS[args.model]
            cfg = LlamaLMConfig(
                vocab_size=shape.vocab_size,
                d_model=shape.d_model,
                n_heads=shape.n_heads,
                n_layers=shape.n_layers,
                max_len=args.seq_len + 1,
                d_ff=shape.d_ff,
            )
            model = new_lm(cfg, seed=0)
            assert isinstance(model, LlamaLM)
            folder = model.save_folder(
                Path(tmp) / "model", [f"t{i}" for i in range(cfg.vocab_size)]
            )
            vocab = cfg.vocab_size
        else:
            folder = Path(args.model)
            if not (folder / "config.json").is_file():
                raise ArgumentError(
                    f"--model {args.model!r}: with --engine vllm, a preset ("
                    f"{', '.join(PRESETS)}) or a Hugging Face model folder"
                )
            config = json.loads((folder / "config.json").read_text())
            vocab = int(config.get("vocab_size", args.vocab))
        log = Path(tmp) / "server.log"
        env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
        python = args.vllm_python or sys.executable
        print(f"starting a vLLM server for {args.model} (log {log})...", file=sys.stderr)
        server = VLLMServer(folder, log, python=python, max_model_len=args.seq_len + 1, env=env)
        with server:
            yield server.url, args.model, vocab


def run(args: argparse.Namespace) -> int:
    import trio

    try:
        import httpx  # noqa: F401 (the client ServedTeachers calls with)
    except ImportError:
        print(
            "groupflow bench-teacher --engine vllm needs httpx: pip install 'groupflow[served]'",
            file=sys.stderr,
        )
        return 2

    from groupflow.impl._teachers import stored_groups
    from groupflow.impl._teachers._torch import random_rows
    from groupflow.impl.contract import ScoreRequest
    from groupflow.impl.engines import ServedTeachers

    with _server(args) as (url, name, vocab):
        scorer = ServedTeachers({"teacher": [url]}, request_timeout_s=CALL_TIMEOUT_S)
        n = args.groups * args.rows_per_group
        rows = random_rows(n, length=args.seq_len, prompt=args.seq_len // 4, vocab=vocab, seed=1)
        store, views = stored_groups(rows, args.rows_per_group)
        field = iter(range(1_000_000))

        async def call(groups: list[Any]) -> None:
            request = ScoreRequest("teacher", tuple(groups), store, f"t{next(field)}")
            await scorer.score(request)  # bounded by request_timeout_s, by cause

        async def batched() -> None:
            await call(views)

        async def separate() -> None:
            for view in views:  # one call per group, in turn: the inline design's order
                await call([view])

        async def timed(fn: Any) -> float:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                await fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        async def measure() -> tuple[float, float]:
            await batched()  # the server's warm-up
            await separate()
            return await timed(batched), await timed(separate)

        t_batched, t_separate = trio.run(measure)
    from groupflow.cli._bench_report import report

    facts = {"engine": "vllm", "model": name, "url": url if args.url is not None else None}
    return report(args, facts, f"served teacher {name} (vLLM)", t_batched, t_separate)
