"""`VLLMServer`: a local vLLM OpenAI-compatible server that groupflow starts and always stops.

Started on 127.0.0.1 at a free port, from a Hugging Face model folder, with its output in a log
file; ready once `/health` answers, within `start_timeout_s` (a server that exits or is not
ready by then is stopped, and the error names its log file and its last lines). Stopped on
leaving the `with` block whatever ended it (success, an error, Ctrl-C), and by the kernel when
this process dies first (Linux: the child is asked to die with its parent).

vLLM is often installed in an environment of its own (its wheels pin torch and pull in
packages of their own): `python` is the interpreter that has it, by default this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import attrs

from groupflow.model.errors import ConfigError, Unavailable

__all__ = ["VLLMServer", "free_port"]

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@attrs.define
class VLLMServer:
    """One vLLM server for the model folder `model`; `url` once started."""

    model: Path = attrs.field(converter=Path)
    log: Path = attrs.field(converter=Path)
    python: str = sys.executable
    max_model_len: int = 256
    dtype: str = "float32"
    start_timeout_s: float = 300.0
    extra_args: Sequence[str] = ()
    env: dict[str, str] = attrs.field(factory=dict)
    """Added to this process's environment (`VLLM_CPU_KVCACHE_SPACE`, say)."""
    port: int | None = None
    process: subprocess.Popen[bytes] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not (self.model / "config.json").is_file():
            raise ConfigError(
                f"VLLMServer.model={str(self.model)!r} is not a Hugging Face model folder "
                f"(no config.json in it)",
                field="model",
                config="VLLMServer",
            )

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("VLLMServer.url: the server is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        """Start the server and wait until it is ready (`Unavailable` naming the log file if it
        does not get there)."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the server's process, not waiting for it. Call it from a thread that outlives
        the server (the main one): the kernel's parent-death signal fires when the *thread*
        that started the child ends, not only its process."""
        if self.port is None:
            self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stopped with its engine workers
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def wait_ready(self) -> None:
        """Wait until the launched server answers `/health`, within `start_timeout_s`; stopped
        and `Unavailable` naming the log file if it exits or is not ready by then. Safe in a
        worker thread (several servers warm up side by side)."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        import httpx

        if self.process is None:
            raise RuntimeError("VLLMServer.wait_ready: launch() the server first")
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(
                    f"the vLLM server for {self.model} exited with status "
                    f"{self.process.returncode} while starting; see {self.log}: {self._tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise Unavailable(
            f"the vLLM server for {self.model} was not ready within {self.start_timeout_s:g} s; "
            f"see {self.log}: {self._tail()}"
        )

    def _tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:]) or "(empty log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the server: asked first, killed `grace_s` later. Safe to call twice."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left
        process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
