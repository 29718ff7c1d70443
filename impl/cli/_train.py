"""`groupflow train`: on-policy distillation of the embedded domains' teachers into one student,
through the pipeline. The embedded default is the project's main job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from groupflow.impl.cli._args import positive
from groupflow.impl.cli._command import Command


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
        import trio

        from groupflow.impl.trainer import TrainConfig, format_summary, provide_teachers, train
    except ImportError as exc:
        print(
            f"groupflow train needs torch and tqdm ({exc.name} is missing): "
            f"pip install 'groupflow[train]'",
            file=sys.stderr,
        )
        return 2
    from groupflow.impl.teachers import resolve_device
    from groupflow.model.errors import Unavailable

    try:
        resolve_device(args.device)
    except Unavailable as exc:
        print(f"groupflow train: --device: {exc}", file=sys.stderr)
        return 2
    out = Path(args.resume if args.resume is not None else args.out)
    if args.resume is not None:
        config = TrainConfig.from_toml(out / "config.toml")
    elif args.config is not None:
        config = TrainConfig.from_toml(args.config)
    else:
        config = TrainConfig()
    if args.steps is not None:
        config = config.evolve(steps=args.steps)
    if args.reward_weight is not None:
        config = config.evolve(reward_weight=args.reward_weight)
    teachers = provide_teachers(
        config, overrides=args.teacher, device=args.device, say=lambda s: print(s, file=sys.stderr)
    )
    summary = trio.run(
        lambda: train(
            config,
            out,
            teachers=teachers,
            resume=args.resume is not None,
            device=args.device,
            progress=None if args.no_progress else _bar,
        )
    )
    print(format_summary(summary), end="")
    if summary.stopped_early:
        print(
            f"stopped at step {summary.steps} of {config.steps}; continue with: groupflow train "
            f"--resume {out}",
            file=sys.stderr,
        )
    return 0


def _bar(total: int, done: int) -> object:
    from groupflow.impl.trainer import progress_bar

    return progress_bar(total, done)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="settings under [train] (every field has a default; see the README)",
    )
    p.add_argument(
        "--steps", type=positive, default=None, help="train steps (overrides the config)"
    )
    p.add_argument(
        "--reward-weight",
        type=float,
        default=None,
        metavar="W",
        help="above 0: a verifier stage after the teacher's writes each response's reward "
        "(1 right, 0 wrong), added to the advantage times W (overrides the config; default 0)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/train"),
        metavar="DIR",
        help="the run folder: config, metrics.jsonl, checkpoints, curves.png (default runs/train)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue the run in DIR from its newest checkpoint, with its config",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees one), cpu, cuda:0")
    p.add_argument(
        "--teacher",
        action="append",
        default=[],
        metavar="DOMAIN=PATH",
        help="use this saved teacher (a TorchTeacher.save file or a Hugging Face "
        "folder) for DOMAIN instead of training one; repeatable",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


COMMAND = Command(
    name="train",
    help="distil domain teachers into one student through the pipeline (the main job)",
    description="Multi-teacher on-policy distillation on the embedded task: one small teacher "
    "per domain (trained on first use, then cached), one student sampled and trained through "
    "groupflow's pipeline. Ctrl-C stops after the current step and saves a checkpoint; "
    "--resume continues.",
    arguments=_arguments,
    run=run,
)
