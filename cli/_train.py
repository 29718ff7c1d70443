"""`groupflow train`: on-policy distillation of the embedded domains' teachers into one student,
through the pipeline. The embedded default is the project's main job."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from groupflow.cli._args import (
    at_least,
    executable_file,
    positive,
    readable_file,
    with_defaults,
    writable_folder,
)
from groupflow.cli._command import Command
from groupflow.impl._core import MAX_RUN_PROMPTS
from groupflow.model.errors import ArgumentError, Unavailable

if TYPE_CHECKING:
    from groupflow.impl._trainer._summary import TrainSummary

OUT = "runs/train"
"""The run folder when `--out` is not given."""


def run(args: argparse.Namespace) -> int:
    _refuse_overrides_on_resume(args)
    try:
        import torch  # noqa: F401

        from groupflow.impl._trainer import RunFolder, TrainConfig
        from groupflow.impl._trainer._provision import provide_teachers
        from groupflow.impl._trainer._run import train
        from groupflow.impl._trainer._summary import format_summary
    except ImportError as exc:
        print(
            f"groupflow train needs torch and tqdm ({exc.name} is missing): "
            f"pip install 'groupflow[train]'",
            file=sys.stderr,
        )
        return 2
    from groupflow.impl._teachers._torch import resolve_device

    _refuse_unused_placement(args)
    args = with_defaults(args, {"teacher_dp": _TEACHER_DP})
    try:
        resolve_device(args.device)
    except Unavailable as exc:
        raise Unavailable(f"--device {args.device}: {exc}") from None
    # a resumed run is resolved here, its config read and its checkpoint verified, before
    # any teacher is trained or loaded
    resumed = RunFolder.resume(args.resume) if args.resume is not None else None
    if resumed is not None:
        config = resumed.config
    elif args.config is not None:
        config = TrainConfig.from_toml(args.config)
    else:
        config = TrainConfig()
    if args.steps is not None:
        config = config.evolve(steps=args.steps)
    if args.reward_weight is not None:
        config = config.evolve(reward_weight=args.reward_weight)
    if args.design is not None:
        config = config.evolve(design=args.design)
    if args.engine is not None:
        config = config.evolve(engine=args.engine)
    _refuse_engine_conflicts(args, config.engine)
    if config.engine == "vllm":
        from groupflow.impl._trainer._engines import check_engine_needs
        from groupflow.impl._trainer._provision import teacher_choices

        _, served = teacher_choices(config, overrides=args.teacher, urls=args.teacher_url)
        check_engine_needs(
            config, student_url=args.student_url, served=served, python=args.vllm_python
        )
    # a new run's folder is checked before any teacher is trained or loaded too
    run_folder = resumed if resumed is not None else RunFolder.new(_out(args), config)
    out = run_folder.path
    teachers = provide_teachers(
        config,
        overrides=args.teacher,
        urls=args.teacher_url,
        device=args.device,
        say=lambda s: print(s, file=sys.stderr),
    )
    with (
        _beyond_one_machine(args, teachers) as (placed, store),
        _engines(args, config, out, placed) as engines,
    ):

        async def run() -> TrainSummary:
            return await train(
                run_folder,
                teachers=placed,
                device=args.device,
                progress=None if args.no_progress else _bar,
                store=store,
                engines=engines,
            )

        summary = _hosted(run, args.host, config.pipeline_config().shutdown_timeout_s)
    print(format_summary(summary), end="")
    if summary.stopped_early:
        print(
            f"stopped at step {summary.steps} of {config.steps}; continue with: groupflow train "
            f"--resume {out}",
            file=sys.stderr,
        )
        return 130  # interrupted (Ctrl-C): the run did not reach its last step
    if summary.accuracy_after is None:
        print(
            f"interrupted after the last step: all {summary.steps} steps are trained and saved "
            f"in {out / 'checkpoints'}; the evaluation after the run was left out",
            file=sys.stderr,
        )
        return 130
    return 0


def _hosted(
    run: Callable[[], Awaitable[TrainSummary]], host: str, shutdown_timeout_s: float
) -> TrainSummary:
    """The run under trio, or hosted on an asyncio loop (`--host asyncio`: what an asyncio
    trainer does with `groupflow.impl.aio`), with Ctrl-C the same either way."""
    if host == "trio":
        import trio

        return trio.run(run)
    from groupflow.impl import aio

    return asyncio.run(aio.host(run, drain_s=2 * shutdown_timeout_s))


def _refuse_overrides_on_resume(args: argparse.Namespace) -> None:
    """A resumed run keeps the settings it was started with (its checkpoints were taken under
    them), so the flags that change them are refused, named, before any work."""
    if args.resume is None:
        return
    given = [
        flag
        for flag, value in (
            ("--config", args.config),
            ("--steps", args.steps),
            ("--reward-weight", args.reward_weight),
            ("--design", args.design),
            ("--engine", args.engine),
        )
        if value is not None
    ]
    if args.out is not None:
        given.append("--out")
    if given:
        raise ArgumentError(
            f"--resume {args.resume} continues the run with the settings in its config.toml; "
            f"drop {', '.join(given)}"
        )


def _refuse_unused_placement(args: argparse.Namespace) -> None:
    """The Ray flags given where nothing runs on Ray, named."""
    if args.teacher_dp is not None and args.teachers_on != "ray":
        raise ArgumentError(
            f"--teacher-dp {args.teacher_dp} sizes the teachers' Ray worker groups: add "
            f"--teachers-on ray, or drop it"
        )
    if args.ray_address is not None and args.teachers_on != "ray" and args.store != "tq":
        raise ArgumentError(
            f"--ray-address {args.ray_address}: nothing runs on Ray; add --teachers-on ray or "
            f"--store tq, or drop it"
        )


def _refuse_engine_conflicts(args: argparse.Namespace, engine: str) -> None:
    """The flags that only mean something on one engine, refused on the other, named."""
    if engine == "vllm" and args.teachers_on == "ray":
        raise ArgumentError(
            "--teachers-on ray runs the teachers in torch on Ray actors; with --engine vllm "
            "they are served by vLLM: drop one of them"
        )
    from groupflow.impl.engines import is_url

    if args.student_url is not None and not is_url(args.student_url):
        raise ArgumentError(f"--student-url {args.student_url!r}: not an http:// or https:// URL")
    if engine != "vllm":
        for flag, value in (
            ("--vllm-python", args.vllm_python),
            ("--student-url", args.student_url),
        ):
            if value is not None:
                raise ArgumentError(f"{flag} is for a run on vLLM: add --engine vllm")


@contextlib.contextmanager
def _engines(
    args: argparse.Namespace, config: Any, out: Path, teachers: Mapping[str, Any]
) -> Iterator[Any]:
    """With `--engine vllm`: a vLLM server for the student and for each teacher not given by
    `--teacher-url`, started before the run and stopped after it, whatever ends it."""
    if config.engine != "vllm":
        yield None
        return
    from groupflow.impl._teachers._torch import resolve_device
    from groupflow.impl._trainer._engines import served_engines

    with served_engines(
        config,
        out,
        {t.name: t.teacher for t in teachers.values()},
        student_url=args.student_url,
        python=args.vllm_python,
        say=lambda s: print(s, file=sys.stderr),
    ) as engines:
        if resolve_device(args.device).type == "cpu":
            import torch

            # vLLM's CPU workers hold the cores while they serve; a learner whose torch splits
            # each step over every core waits on the slowest (measured: 1.5x the steps/s)
            torch.set_num_threads(1)
        yield engines


def _out(args: argparse.Namespace) -> Path:
    """`--out`, checked when parsed, or the default folder, checked here."""
    if args.out is not None:
        return Path(args.out)
    try:
        return writable_folder(OUT)
    except argparse.ArgumentTypeError as exc:
        raise ArgumentError(f"the default --out {OUT}: {exc}; give --out DIR") from None


ACTOR_CPUS = 0.5
"""Ray CPUs each teacher actor of a local Ray reserves (`--teachers-on ray`)."""
TQ_CPUS = 2
"""Ray CPUs TransferQueue takes: its controller and one storage unit (`--store tq`)."""


def _ship(teacher: Any) -> Any:
    """A teacher actor's factory: the teacher built here, sent to the actor by value (the
    embedded teachers are small; on a cluster, load from a path every node reaches)."""
    return teacher


_TEACHER_DP = 2
"""Actors (DP ranks) per teacher on Ray, by default."""


@contextlib.contextmanager
def _beyond_one_machine(
    args: argparse.Namespace, teachers: Mapping[str, Any]
) -> Iterator[tuple[Mapping[str, Any], Any]]:
    """With `--teachers-on ray` each physical teacher runs as a Ray worker group (`--teacher-dp`
    actors); with `--store tq` the rows live in TransferQueue. Both on the Ray at
    `--ray-address`, or a local one sized for them; everything is shut down at the end."""
    if args.teachers_on == "process" and args.store == "memory":
        yield teachers, None
        return
    from groupflow.impl._core import keep_ray_local

    if args.ray_address is None:
        keep_ray_local()  # before Ray is imported (TransferQueue imports it): 127.0.0.1 only
    from groupflow.impl._core import RaySettings, ray_session
    from groupflow.impl._teachers._ray import RayTeacherConfig, RayTeacherGroup
    from groupflow.impl._trainer._provision import DomainTeacher

    physical = {t.name: t.teacher for t in teachers.values()}
    actors = 0 if args.teachers_on == "process" else len(physical) * args.teacher_dp
    cpus = (TQ_CPUS if args.store == "tq" else 0) + math.ceil(actors * ACTOR_CPUS)
    settings = RaySettings(
        address=args.ray_address, num_cpus=None if args.ray_address else max(cpus, 1)
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(ray_session(settings))
        if args.teachers_on == "ray":
            groups = {
                name: stack.enter_context(
                    RayTeacherGroup.start(
                        functools.partial(_ship, teacher),
                        RayTeacherConfig(
                            dp_size=args.teacher_dp, num_cpus_per_actor=ACTOR_CPUS, name=name
                        ),
                    )
                )
                for name, teacher in physical.items()
            }
            teachers = {d: DomainTeacher(t.name, groups[t.name]) for d, t in teachers.items()}
        store = None
        if args.store == "tq":
            from groupflow.impl._core._tq_store import TransferQueueStore

            store = stack.enter_context(TransferQueueStore.open())
        print(
            f"teachers: {args.teachers_on}"
            + (f" ({len(physical)} worker groups of {args.teacher_dp} actors)" if actors else "")
            + f"; store: {args.store}; Ray: {args.ray_address or f'local, {settings.num_cpus} CPUs'}",
            file=sys.stderr,
        )
        yield teachers, store


def _bar(total: int, done: int) -> object:
    from groupflow.impl._trainer._summary import progress_bar

    return progress_bar(total, done)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=readable_file,
        default=None,
        metavar="FILE.toml",
        help="settings under [train] (every field has a default; see the README)",
    )
    p.add_argument(
        "--steps",
        type=at_least(1, at_most=MAX_RUN_PROMPTS),
        default=None,
        help="train steps (overrides the config)",
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
        "--design",
        choices=["pump", "inline"],
        default=None,
        help="pump: a stage batches teacher calls across groups, the permit free at commit "
        "(default); inline: each group scored inside its rollout, holding its permit, as "
        "upstream trainers do (overrides the config)",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default=None,
        help="torch: the student samples and the teachers score in this process (default); "
        "vllm: on local vLLM servers groupflow starts and stops (overrides the config)",
    )
    p.add_argument(
        "--out",
        type=writable_folder,
        default=None,
        metavar="DIR",
        help=f"the run folder: config, metrics.jsonl, checkpoints, curves.png (default {OUT})",
    )
    p.add_argument(
        "--resume",
        type=writable_folder,
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
    p.add_argument(
        "--teacher-url",
        action="append",
        default=[],
        metavar="DOMAIN=URL",
        help="with --engine vllm: DOMAIN's teacher is the OpenAI-compatible server at URL (one "
        "you run) instead of one groupflow starts; repeatable",
    )
    p.add_argument(
        "--student-url",
        default=None,
        metavar="URL",
        help="with --engine vllm: the student is the server at URL (one you run, with "
        "VLLM_SERVER_DEV_MODE=1, from a local folder of the run's student shape, such as "
        "RUN_DIR/engines/student of an earlier run); groupflow writes its weights there",
    )
    p.add_argument(
        "--vllm-python",
        type=executable_file,
        default=None,
        metavar="PYTHON",
        help="with --engine vllm: the interpreter that has vLLM (default $GROUPFLOW_VLLM_PYTHON, "
        "else this one)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--host",
        choices=["trio", "asyncio"],
        default="trio",
        help="the event loop the run is on: trio (default), or asyncio with trio as its guest "
        "(groupflow.impl.aio, as an asyncio trainer hosts it)",
    )
    beyond = p.add_argument_group("beyond one machine (extras ray and tq)")
    beyond.add_argument(
        "--teachers-on",
        choices=["process", "ray"],
        default="process",
        help="where the teachers run: in this process (default), or as Ray worker groups, one "
        "actor per DP rank (needs groupflow[ray])",
    )
    beyond.add_argument(
        "--store",
        choices=["memory", "tq"],
        default="memory",
        help="where the rows live: in memory (default), or in TransferQueue on Ray (needs "
        "groupflow[tq])",
    )
    beyond.add_argument(
        "--teacher-dp",
        type=positive,
        default=None,
        metavar="N",
        help=f"with --teachers-on ray: actors (DP ranks) per teacher (default {_TEACHER_DP})",
    )
    beyond.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to use ('auto', or ray://HEAD:10001); default: start a local Ray "
        "sized for the teachers and the store",
    )


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
