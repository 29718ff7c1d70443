"""Where a `groupflow train` run spends its time: groupflow's core (buffer, ledger, pumps,
supervisor, stage, observer and trace, the lifecycle model) against everything else (model
compute, the trainer, trio, waiting), on the trio thread, by sampling its stack.

Run: `python bench/trainer_profile.py [--steps N]` (a minute or two on two cores). It trains
the embedded default (`TrainConfig()`, N steps; teachers from the cache, trained first if
absent) while a daemon thread samples every thread's stack with `sys._current_frames()` about
every millisecond, each sample weighted by the time since the one before. Nothing is hooked
into the interpreter (no `sys.setprofile`), so pure-Python code is not slowed down more than
the C code torch runs, as it is under cProfile (`--mode cprofile` keeps that measurement).

Each sample of the trio thread falls in one class, first match wins:

- waiting: the innermost frame is trio's I/O poll or a thread wait (the trio thread is idle,
  or blocks on a worker);
- core, own: the innermost frame is in `groupflow.impl._core`, `groupflow.impl._pipeline` or
  `groupflow.model`;
- core, callees: a core frame is on the stack and every frame inside the innermost one is
  the standard library, attrs or trio (the JSON encoder the trace calls, attrs' generated
  `__init__`, a trio `Event.set`): time the core spends, paid in libraries;
- model and trainer: a frame inside the innermost core frame (or anywhere, when no core frame
  is on the stack) is torch, the trainer, the teachers or their libraries (tensorboard, tqdm,
  matplotlib, numpy);
- trio and other: the rest (trio's scheduler between tasks, the standard library alone).

Own time is a lower bound of the core's cost, own plus callees (inclusive) the figure the
2% goal is about: the wall time the core adds around the model's compute. Both are printed
as shares of the `train()` call's wall time (what the cProfile figure was measured against)
and of `pipeline.run()`'s alone (the steps, without building the models and the greedy
evaluations before and after, so a stricter denominator). Worker threads (sampling, the
teacher calls, the refit) are sampled too; the core code that runs on them (the threaded
scorer's bookkeeping) is printed apart.

A thread waiting to take the GIL back stays in the frame that released it, so that wait
counts where it happens: after the trace's `write` (a system call, which releases the GIL to
the sampling and scoring threads) it is the core's, after a torch call the model's. A core
frame that blocks in C without releasing the GIL counts as core own time (nothing in the core
does, on trio's thread, but that is why it is not "waiting").

The sampler takes the GIL to read the stacks: `--switch-interval` (default 0.5 ms, Python's
is 5 ms) bounds how long it waits for it, so that samples are not taken only when the trio
thread has released the GIL (in torch or in the I/O poll), which would hide pure-Python
code. `--sampler off` runs without sampling, to measure the sampler's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import trio

import groupflow.impl._core
import groupflow.impl._pipeline
import groupflow.impl._teachers
import groupflow.impl._trainer
import groupflow.model
from groupflow.impl._pipeline import Pipeline
from groupflow.impl._trainer import RunFolder, TrainConfig
from groupflow.impl._trainer._provision import provide_teachers
from groupflow.impl._trainer._run import train

CORE = ("/impl/_core/", "/impl/_pipeline/", "/model/")
"""cProfile mode: the core's files by path."""


def _folder(module: Any) -> str:
    return str(Path(module.__file__).resolve().parent) + "/"


CORE_FOLDERS = tuple(
    _folder(m) for m in (groupflow.impl._core, groupflow.impl._pipeline, groupflow.model)
)
APP_FOLDERS = tuple(_folder(m) for m in (groupflow.impl._trainer, groupflow.impl._teachers))
APP_PACKAGES = ("torch", "tensorboard", "tqdm", "matplotlib", "numpy", "google", "PIL")
WAITS = {
    ("_io_epoll.py", "get_events"),
    ("_io_kqueue.py", "get_events"),
    ("_io_windows.py", "get_events"),
    ("threading.py", "wait"),
    ("threading.py", "join"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("selectors.py", "select"),
    ("_thread_cache.py", "_work"),
}
"""(file name, function) of frames that, innermost, mean the thread waits."""

WAITING, CORE_OWN, CORE_CALLEES, MODEL, OTHER = (
    "waiting (trio's I/O poll, thread waits)",
    "core, own time",
    "core, callees (stdlib, attrs, trio)",
    "model and trainer (torch, trainer, teachers, ...)",
    "trio scheduler and other",
)
CLASSES = (CORE_OWN, CORE_CALLEES, MODEL, WAITING, OTHER)

Stack = tuple[CodeType, ...]
"""Code objects, innermost first."""


class _Kinds:
    """Which part of the program a code object belongs to, cached by code object."""

    def __init__(self) -> None:
        self._kind: dict[CodeType, str] = {}

    def __call__(self, code: CodeType) -> str:
        kind = self._kind.get(code)
        if kind is None:
            kind = self._kind[code] = self._classify(code)
        return kind

    @staticmethod
    def _classify(code: CodeType) -> str:
        path = code.co_filename
        if path.startswith("<"):
            return "lib"  # attrs' generated methods, frozen stdlib modules
        resolved = str(Path(path).resolve())
        if resolved.startswith(CORE_FOLDERS):
            return "core"
        if resolved.startswith(APP_FOLDERS):
            return "app"
        parts = Path(resolved).parts
        if "site-packages" in parts or "dist-packages" in parts:
            at = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
            if at + 1 < len(parts) and parts[at + 1] in APP_PACKAGES:
                return "app"
        return "lib"


def classify(stack: Stack, kinds: _Kinds) -> tuple[str, int | None]:
    """The sample's class, and the index of the innermost core frame (None without one)."""
    if not stack:
        return OTHER, None
    leaf = stack[0]
    if (Path(leaf.co_filename).name, leaf.co_name) in WAITS:
        return WAITING, None
    innermost = next((i for i, code in enumerate(stack) if kinds(code) == "core"), None)
    if innermost == 0:
        return CORE_OWN, 0
    inside = stack[:innermost] if innermost is not None else stack
    if any(kinds(code) == "app" for code in inside):
        return MODEL, innermost
    if innermost is not None:
        return CORE_CALLEES, innermost
    return OTHER, None


class StackSampler:
    """A daemon thread that reads every thread's stack about every `interval` seconds and
    sums, per (phase, thread kind, stack), the time since the previous sample."""

    def __init__(self, trio_thread: int, interval: float = 0.001, others_every: int = 10) -> None:
        self.trio_thread = trio_thread
        self.interval = interval
        self.others_every = others_every
        """The other threads are read every this many samples (the trio thread at each)."""
        self.phase = "setup"
        """Set by the measured thread: the samples are summed per phase."""
        self.time: defaultdict[tuple[str, bool, Stack], float] = defaultdict(float)
        """(phase, on the trio thread, stack) -> seconds."""
        self.cpu: defaultdict[tuple[str, Stack], float] = defaultdict(float)
        """(phase, stack) -> CPU seconds of the trio thread (where the platform tells a
        thread's CPU time to another thread: `time.pthread_getcpuclockid`)."""
        self.samples = 0
        self.unreadable = 0
        """Samples whose stack could not be read (a frame caught half made): left out."""
        self._time: dict[tuple[str, bool, tuple[int, ...]], float] = {}
        self._cpu: dict[tuple[str, tuple[int, ...]], float] = {}
        self._codes: dict[int, CodeType] = {}
        self.cpu_s = 0.0
        """The sampler thread's own CPU time."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me, trio_thread = threading.get_ident(), self.trio_thread
        try:
            clock: int | None = time.pthread_getcpuclockid(trio_thread)
        except (AttributeError, OSError):  # not on this platform
            clock = None
        last = last_all = time.perf_counter()
        last_cpu = time.clock_gettime(clock) if clock is not None else 0.0
        while not self._stop.is_set():
            time.sleep(self.interval)
            now = time.perf_counter()
            weight, last = now - last, now
            phase = self.phase
            frames = sys._current_frames()
            stack = self._stack(frames.get(trio_thread))
            if stack is None:
                self.unreadable += 1
                continue
            key = (phase, True, stack)
            self._time[key] = self._time.get(key, 0.0) + weight
            if clock is not None:
                cpu = time.clock_gettime(clock)
                spent, last_cpu = cpu - last_cpu, cpu
                self._cpu[phase, stack] = self._cpu.get((phase, stack), 0.0) + spent
            self.samples += 1
            if self.samples % self.others_every == 0:  # the other threads, less often
                weight, last_all = now - last_all, now
                for ident, frame in frames.items():
                    if ident not in (me, trio_thread):
                        other = self._stack(frame)
                        if other is not None:
                            key = (phase, False, other)
                            self._time[key] = self._time.get(key, 0.0) + weight
            del frames
        self.cpu_s = time.thread_time()
        codes = self._codes
        for (phase, on_trio, ids), seconds in self._time.items():
            self.time[phase, on_trio, tuple(codes[i] for i in ids)] += seconds
        for (phase, ids), seconds in self._cpu.items():
            self.cpu[phase, tuple(codes[i] for i in ids)] += seconds

    def _stack(self, frame: FrameType | None) -> tuple[int, ...] | None:
        """The stack as the ids of its code objects (a code object's own hash reads all of
        its bytecode: far too slow to take a thousand times a second); None if a frame on
        it is not readable (seen once on CPython 3.11: a frame whose `f_code` is missing)."""
        ids = []
        codes = self._codes
        while frame is not None:
            code = getattr(frame, "f_code", None)
            if not isinstance(code, CodeType):
                return None
            key = id(code)
            if key not in codes:
                codes[key] = code  # kept alive: its id is not reused
            ids.append(key)
            frame = frame.f_back
        return tuple(ids)


class _Collections:
    """Times the garbage collector's passes on the trio thread (`gc.callbacks`), with the
    stack that triggered each: a pass holds the GIL, so the sampler sees its time in the
    frame that allocated when it ran."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.seconds = 0.0
        self.stacks: list[tuple[Stack, float]] = []
        self._began = 0.0

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        self.seconds += seconds
        codes = []
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        self.stacks.append((tuple(codes), seconds))


def _where(code: CodeType) -> str:
    path = Path(code.co_filename)
    return f"{path.parent.name}/{path.name}:{code.co_firstlineno}({code.co_name})"


def _train(config: TrainConfig, teachers: Any, folder: Path) -> None:
    trio.run(
        lambda: train(
            RunFolder.new(folder / "run", config),
            teachers=teachers,
            device="cpu",
            progress=None,
            plot=False,
        )
    )


@contextlib.contextmanager
def _phases(sampler: StackSampler | None) -> Iterator[None]:
    """Mark `pipeline.run()` as the phase "steps" (the bench wraps the method; the run is
    unchanged)."""
    original = Pipeline.run

    async def run(self: Pipeline) -> Any:
        if sampler is not None:
            sampler.phase = "steps"
        began = time.perf_counter()
        try:
            return await original(self)
        finally:
            _STEPS_WALL.append(time.perf_counter() - began)
            if sampler is not None:
                sampler.phase = "after"

    Pipeline.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pipeline.run = original  # type: ignore[method-assign]


_STEPS_WALL: list[float] = []


def sample_mode(args: argparse.Namespace, config: TrainConfig, teachers: Any) -> None:
    sys.setswitchinterval(args.switch_interval)
    sampler = StackSampler(threading.get_ident(), args.interval) if args.sampler == "on" else None
    collections = _Collections(threading.get_ident())
    with tempfile.TemporaryDirectory() as tmp, _phases(sampler), collections:
        with sampler if sampler is not None else contextlib.nullcontext():
            began = time.perf_counter()
            _train(config, teachers, Path(tmp))
            wall = time.perf_counter() - began  # not the sampler's sums, made as it stops
    steps_wall = _STEPS_WALL[-1]
    print(
        f"steps: {args.steps}, train() call {wall:.1f} s, pipeline.run() {steps_wall:.1f} s, "
        f"{args.steps / steps_wall:.2f} steps/s in pipeline.run() (switch interval "
        f"{1000 * sys.getswitchinterval():.2f} ms, sampler {args.sampler})"
    )
    if sampler is None:
        return
    print(
        f"samples: {sampler.samples} (every {1000 * args.interval:.1f} ms asked, "
        f"{1000 * wall / max(1, sampler.samples):.2f} ms on average, {sampler.unreadable} "
        f"unreadable left out); sampler thread CPU "
        f"{sampler.cpu_s:.2f} s = {100 * sampler.cpu_s / wall:.2f}% of the wall time"
    )
    kinds = _Kinds()
    by_class: dict[str, defaultdict[str, float]] = {
        "all": defaultdict(float),
        "steps": defaultdict(float),
    }
    own: defaultdict[CodeType, float] = defaultdict(float)
    inclusive: defaultdict[CodeType, float] = defaultdict(float)
    callees: defaultdict[CodeType, float] = defaultdict(float)
    other_threads: defaultdict[str, float] = defaultdict(float)
    elsewhere: defaultdict[CodeType, float] = defaultdict(float)
    others: defaultdict[CodeType, float] = defaultdict(float)
    for (phase, on_trio, stack), seconds in sampler.time.items():
        kind, innermost = classify(stack, kinds)
        if not on_trio:
            if kind in (CORE_OWN, CORE_CALLEES):
                other_threads[kind] += seconds
                if innermost is not None:
                    elsewhere[stack[innermost]] += seconds
            continue
        by_class["all"][kind] += seconds
        if phase == "steps":
            by_class["steps"][kind] += seconds
        if kind == CORE_OWN:
            own[stack[0]] += seconds
        if kind in (CORE_OWN, CORE_CALLEES) and innermost is not None:
            inclusive[stack[innermost]] += seconds
        if kind == CORE_CALLEES:
            callees[stack[0]] += seconds
        if kind == OTHER and stack:
            others[stack[0]] += seconds
    cpu_by_class: defaultdict[str, float] = defaultdict(float)
    for (phase, stack), seconds in sampler.cpu.items():
        if phase == "steps":
            cpu_by_class[classify(stack, kinds)[0]] += seconds
    cpu_total = max(sum(cpu_by_class.values()), 1e-9)
    sampled = {phase: sum(c.values()) for phase, c in by_class.items()}
    print()
    print(
        f"trio thread, share of the {'':<24} {'wall time':>14} {'wall time':>15} {'CPU time':>15}"
    )
    print(f"  {'':<48} {'train() call':>14} {'pipeline.run()':>15} {'pipeline.run()':>15}")
    print(
        f"  {'sampled':<48} {sampled['all']:>12.1f} s {sampled['steps']:>13.1f} s "
        f"{cpu_total:>13.1f} s"
    )
    for kind in CLASSES:
        print(
            f"  {kind:<48} {100 * by_class['all'][kind] / sampled['all']:>13.2f}% "
            f"{100 * by_class['steps'][kind] / max(sampled['steps'], 1e-9):>14.2f}% "
            f"{100 * cpu_by_class[kind] / cpu_total:>14.2f}%"
        )
    for phase, label in (("all", "train() call"), ("steps", "pipeline.run()")):
        c, total = by_class[phase], max(sampled[phase], 1e-9)
        busy = max(total - c[WAITING], 1e-9)
        core_own, core_incl = c[CORE_OWN], c[CORE_OWN] + c[CORE_CALLEES]
        print(
            f"core share, {label:<15}: own {100 * core_own / total:.2f}%, inclusive "
            f"{100 * core_incl / total:.2f}% of the wall time ({core_own:.2f} s, "
            f"{core_incl:.2f} s); of the trio thread's busy time (not waiting): own "
            f"{100 * core_own / busy:.2f}%, inclusive {100 * core_incl / busy:.2f}%"
        )
    core_cpu = cpu_by_class[CORE_OWN] + cpu_by_class[CORE_CALLEES]
    print(
        f"core share of the trio thread's CPU time in pipeline.run(): own "
        f"{100 * cpu_by_class[CORE_OWN] / cpu_total:.2f}%, inclusive "
        f"{100 * core_cpu / cpu_total:.2f}% ({core_cpu:.2f} s of {cpu_total:.2f} s)"
    )
    print(
        f"core on the other threads (worker threads, beside trio's): own "
        f"{other_threads[CORE_OWN]:.2f} s, callees {other_threads[CORE_CALLEES]:.2f} s"
    )
    _top("the core's costliest functions, own time", own, args.top)
    _top("the core's costliest functions, inclusive (innermost core frame)", inclusive, args.top)
    _top("what the core's time in callees is spent in (innermost frame)", callees, args.top)
    _top("the core on the other threads, inclusive (innermost core frame)", elsewhere, 5)
    _top("trio scheduler and other, by innermost frame", others, 8)
    in_core = sum(
        seconds
        for stack, seconds in collections.stacks
        if classify(stack, kinds)[0] in (CORE_OWN, CORE_CALLEES)
    )
    print(
        f"garbage collection on the trio thread: {collections.seconds:.2f} s in "
        f"{len(collections.stacks)} passes ({100 * collections.seconds / wall:.2f}% of the "
        f"wall time), counted where it was triggered; of it triggered in the core (own or callees): "
        f"{in_core:.3f} s (included in the core's figures above)"
    )


def _top(title: str, times: Mapping[CodeType, float], n: int) -> None:
    print(f"{title}:")
    for code, seconds in sorted(times.items(), key=lambda item: -item[1])[:n]:
        print(f"  {seconds:7.3f} s  {_where(code)}")


def cprofile_mode(args: argparse.Namespace, config: TrainConfig, teachers: Any) -> None:
    """The earlier measurement: cProfile over the trio thread, the core's own time."""
    with tempfile.TemporaryDirectory() as tmp:
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        _train(config, teachers, Path(tmp))
        profile.disable()
        wall = time.perf_counter() - began
    stats = pstats.Stats(profile)
    core = total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if any(part in filename.replace("\\", "/") for part in CORE):
            core += tottime
    rows = sorted(
        (
            (tottime, f"{Path(filename).parent.name}/{Path(filename).name}:{line}({function})")
            for (filename, line, function), (_, _, tottime, _, _) in stats.stats.items()  # type: ignore[attr-defined]
            if any(part in filename.replace("\\", "/") for part in CORE)
        ),
        reverse=True,
    )
    print("the core's costliest functions (own time):")
    for tottime, where in rows[: args.top]:
        print(f"  {tottime:7.3f} s  {where}")
    print(f"steps: {args.steps}, wall {wall:.1f} s, {args.steps / wall:.2f} steps/s")
    print(f"trio thread, profiled: {total:.2f} s; of it in groupflow's core: {core:.3f} s")
    print(
        f"core share: {100 * core / total:.2f}% of the profiled thread, "
        f"{100 * core / wall:.2f}% of wall time"
    )


MODES: dict[str, Callable[[argparse.Namespace, TrainConfig, Any], None]] = {
    "sample": sample_mode,
    "cprofile": cprofile_mode,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=12, help="list this many core functions")
    parser.add_argument("--mode", choices=sorted(MODES), default="sample")
    parser.add_argument("--sampler", choices=("on", "off"), default="on")
    parser.add_argument("--interval", type=float, default=0.001, help="seconds between samples")
    parser.add_argument(
        "--switch-interval", type=float, default=0.0005, help="sys.setswitchinterval, seconds"
    )
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps)
    teachers = provide_teachers(config, device="cpu")
    MODES[args.mode](args, config, teachers)


if __name__ == "__main__":
    main()
