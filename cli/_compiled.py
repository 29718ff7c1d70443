"""`groupflow check --compiled`: the same search, its model modules compiled by mypyc.

The checker spends its time in the interpreter: each state costs the guards, the handlers, the
checks and the explorer's bookkeeping in bytecode. mypyc compiles those modules, unchanged, to C
extensions (about twice as fast), built once per source and kept in the cache folder. The
command then runs again in a child process whose `groupflow.model` is that compiled copy: the
same arguments, output, progress and Ctrl-C, the pure modules of this process untouched (the
pipeline, the tests and their seeded bugs keep patching those).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from groupflow.model.errors import Unavailable

COMPILED = (
    "decisions.py",
    "scheduler/canonical.py",
    "scheduler/checks.py",
    "scheduler/explorer.py",
    "scheduler/guards.py",
    "scheduler/reduction.py",
    "scheduler/state.py",
    "scheduler/transitions.py",
)
"""The model's modules that are compiled, under `groupflow/model/`: the search and what it calls
per state. The others (the attrs classes of the bounds, shape and errors among them) stay
Python, copied beside them."""

COMPILE_TIMEOUT_S = 900.0
"""At most this long for mypyc and the C compiler (about a minute on two cores)."""

_DONE = "compiled.ok"
"""Written last in a finished build: a folder without it is not used."""

_CHILD = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
from groupflow.cli._compiled import check_loaded
check_loaded(sys.argv[1])
from groupflow.cli._check import run
sys.exit(run(pickle.load(sys.stdin.buffer)))
"""


def source_key(model: Path) -> str:
    """What a build depends on: every source file of the model, this Python, and mypyc."""
    import mypy.version

    digest = hashlib.sha256()
    for path in sorted(model.rglob("*.py")):
        digest.update(path.relative_to(model).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(f"{sys.version}|{sysconfig.get_platform()}|{mypy.version.__version__}".encode())
    return digest.hexdigest()[:20]


def has_mypyc() -> bool:
    return importlib.util.find_spec("mypyc") is not None


def model_source() -> Path:
    """The folder `groupflow.model` is imported from in this process."""
    import groupflow.model

    return Path(groupflow.model.__file__).parent


def compiled_model(cache: Path, say: Callable[[str], None] | None = None) -> Path:
    """A folder that holds `groupflow/model`, its `COMPILED` modules built by mypyc from this
    process's source; built now if the cache has none for this source (`say` hears that)."""
    if not has_mypyc():
        raise Unavailable(
            "--compiled needs mypyc, which comes with mypy: pip install 'groupflow[compile]' "
            "(and a C compiler with the Python headers)"
        )
    source = model_source()
    target = cache / "compiled" / source_key(source)
    if (target / _DONE).exists():
        return target
    if say is not None:
        say(f"compiling the model with mypyc into {target} (once for this source: a minute)")
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
    try:
        _build(source, work)
        (work / _DONE).write_text("ok\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            work.rename(target)
        except OSError:  # built meanwhile by another process: theirs is as good
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _build(source: Path, work: Path) -> None:
    model = work / "groupflow" / "model"
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    files = [str(Path("groupflow/model") / name) for name in COMPILED]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", "--explicit-package-bases", *files],
            cwd=work,
            env={**os.environ, "MYPYPATH": str(work)},
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(
            f"mypyc did not finish compiling the model in {COMPILE_TIMEOUT_S:.0f} s"
        ) from exc
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        raise Unavailable(
            f"mypyc could not compile the model (exit {done.returncode}): "
            f"{lines[-1] if lines else 'no output'}"
        )
    shutil.rmtree(work / "build", ignore_errors=True)
    shutil.rmtree(work / ".mypy_cache", ignore_errors=True)


def check_loaded(folder: str) -> None:
    """In the child: every `COMPILED` module is the extension built in `folder`, or the child
    stops before any search (a pure module would give the pure rate under the compiled name)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for name in COMPILED:
        module = "groupflow.model." + name.removesuffix(".py").replace("/", ".")
        origin = getattr(importlib.import_module(module), "__file__", None) or ""
        if not (origin.startswith(folder) and origin.endswith(suffix)):
            sys.exit(f"groupflow check: --compiled imported {module} from {origin}, not {folder}")


def rerun(args: object, folder: Path) -> int:
    """The check command again, in a child process on the compiled model in `folder`; its exit
    status. Ctrl-C reaches the child, which reports it as the command does."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(folder)], stdin=subprocess.PIPE)
    assert child.stdin is not None
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        child.stdin.write(pickle.dumps(args))
        child.stdin.close()
        return child.wait()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
