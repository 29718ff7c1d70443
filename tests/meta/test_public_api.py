"""The public API is deliberate: `groupflow.impl` exports what the README tells users to call,
each subpackage exports its public names, and the README's examples import only from them."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

import groupflow.impl
from groupflow.model import errors
from tests.helpers import user_pages

PUBLIC_API = {
    # the pipeline: build it, configure it, feed it, resume it
    "build_pipeline",
    "Pipeline",
    "RunResult",
    "StepRecord",
    "PipelineConfig",
    "ScoringConfig",
    "Shape",
    "CheckpointConfig",
    "Dispatch",
    # the enums the configs take
    "CheckpointPolicy",
    "Design",
    "FailurePolicy",
    "DEFAULT_TRANSIENT_ERRORS",
    "ExtraStage",
    "StallAction",
    "load_checkpoint",
    "Checkpoint",
    # the trace every run can write, for `groupflow replay`
    "TraceWriter",
    # the parts a user brings (also in groupflow.impl.contract)
    "Generator",
    "GenerateRequest",
    "Learner",
    "StatelessLearner",
    "TrainBatch",
    "TEACHER_FIELD",
    "Scorer",
    "ScoreRequest",
    "ThreadedScorer",
    "Teacher",
    "TokenRow",
    "GroupView",
    # the teacher backends
    "TeacherScorer",
    "TorchTeacher",
    "LMConfig",
    "HFTeacher",
    "RoutingConfig",
    "teacher_by_agent",
    # served engines: vLLM and other OpenAI-compatible servers (extra `served`)
    "ServedTeachers",
    "ServedGenerator",
    "VLLMServer",
    # beyond one machine: Ray (extra `ray`)
    "RaySettings",
    "ray_session",
    "keep_ray_local",
    "RayTeacherConfig",
    "RayTeacherGroup",
    # beyond one machine: TransferQueue (extra `tq`)
    "TransferQueueStore",
    # the core
    "ReplayBuffer",
    "BufferConfig",
    "Sampler",
    "Selection",
    "Row",
    "MemoryStore",
    "SampleStore",
}
"""What users call. The errors are in `groupflow.impl.errors`, the contract in
`groupflow.impl.contract` (see below)."""

LAZY = {"TorchTeacher", "LMConfig", "HFTeacher"}
"""Exported names whose modules need torch: loaded on first use."""
LAZY_WITHOUT_TORCH = {"RayTeacherConfig", "RayTeacherGroup"}
"""Loaded on first use too; their module imports Ray only when a group starts."""

SUBPACKAGES = ("engines",)
INTERNAL = ("_core", "_pipeline", "_teachers", "_trainer")
"""The subpackages that do the work, named internal: what they export is for each other."""
TIERS = ("contract", "errors", "testing", "aio")
"""Public modules beside `groupflow.impl`: the contract a user implements, the errors, the fakes
for tests, the host for asyncio trainers."""

AIO = {"AsyncioPart", "GuestRun", "host", "part", "run", "start_guest", "teacher_scorer"}
"""`groupflow.impl.aio`: a run hosted on asyncio, and parts written for it."""


def _errors() -> set[str]:
    return {name for name in errors.__all__ if isinstance(getattr(errors, name), type)}


CONTRACT = {
    "TEACHER_FIELD",
    "GenerateRequest",
    "Generator",
    "GroupView",
    "Learner",
    "ScoreRequest",
    "Scorer",
    "StatelessLearner",
    "Teacher",
    "TokenRow",
    "TrainBatch",
}
"""The protocols of the parts a user brings, and the values they are handed."""


def test_the_exported_names_are_pinned() -> None:
    assert set(groupflow.impl.__all__) == PUBLIC_API
    assert len(groupflow.impl.__all__) == len(set(groupflow.impl.__all__))
    assert len(PUBLIC_API) == 52


def test_the_tiers_are_pinned() -> None:
    import groupflow.impl.contract as contract
    import groupflow.impl.errors as public_errors

    assert set(contract.__all__) == CONTRACT
    import groupflow.impl.aio as aio

    assert set(aio.__all__) == AIO
    assert CONTRACT - {"TokenRow", "GroupView"} <= PUBLIC_API
    assert set(public_errors.__all__) == _errors()
    for name in _errors():
        assert getattr(public_errors, name) is getattr(errors, name), name


@pytest.mark.parametrize("name", sorted(_errors()))
def test_a_traceback_names_the_error_by_its_public_module(name: str) -> None:
    import traceback

    import groupflow.impl.errors as public_errors

    cls = getattr(public_errors, name)
    assert cls.__module__ == "groupflow.impl.errors"
    try:
        raise cls.__new__(cls)
    except cls as caught:
        line = traceback.format_exception_only(type(caught), caught)[-1]
    assert line.startswith(f"groupflow.impl.errors.{name}"), line


@pytest.mark.parametrize("name", ["score_teacher_batch", "PumpFailed", "TRACE_FILE", "part_name"])
def test_a_name_is_found_only_in_its_home(name: str) -> None:
    """Each name is written once: `groupflow.impl` does not also answer for a tier's names."""
    with pytest.raises(AttributeError, match=f"has no attribute {name!r}"):
        getattr(groupflow.impl, name)


def test_nothing_else_is_public_at_the_top() -> None:
    public = {n for n in vars(groupflow.impl) if not n.startswith("_")}
    assert public - set(groupflow.impl.__all__) <= set(SUBPACKAGES) | set(TIERS)


@pytest.mark.parametrize("name", sorted(PUBLIC_API))
def test_every_exported_name_resolves(name: str) -> None:
    if name == "TransferQueueStore":
        pytest.importorskip("transfer_queue", reason="the tq extra is not installed")
    if name in LAZY:
        pytest.importorskip("torch", reason="torch not installed")
    if name == "HFTeacher":
        pytest.importorskip("transformers", reason="transformers not installed")
    assert getattr(groupflow.impl, name) is not None


@pytest.mark.parametrize("sub", SUBPACKAGES + TIERS + INTERNAL)
def test_subpackages_export_names_that_resolve(sub: str) -> None:
    module = importlib.import_module(f"groupflow.impl.{sub}")
    assert module.__all__, sub
    for name in module.__all__:
        assert not name.startswith("_"), name
        assert getattr(module, name) is not None


@pytest.mark.parametrize("sub", SUBPACKAGES + TIERS + INTERNAL)
def test_only_the_facade_loads_names_lazily(sub: str) -> None:
    """One lazy-import mechanism: `groupflow.impl` loads its extras' names on first use; inside,
    a module that needs an extra is imported where it is used."""
    assert not hasattr(importlib.import_module(f"groupflow.impl.{sub}"), "__getattr__"), sub


def test_the_subpackages_import_without_torch() -> None:
    """torch is an extra: with it hidden, every subpackage still imports."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        + "".join(f"import groupflow.impl.{sub}\n" for sub in SUBPACKAGES + TIERS + INTERNAL)
        + "import groupflow.impl\n"
        + "import groupflow.cli\n"
        + "from groupflow.impl._trainer import parse_teacher_override\n"
        + "assert parse_teacher_override('count=x.pt')[0] == 'count'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_ray_names_load_lazily_and_without_ray() -> None:
    """The Ray teacher group's module is loaded on first use, and Ray only when a group or
    a session starts: `import groupflow.impl` never needs Ray."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import groupflow.impl\n"
        "assert 'groupflow.impl._teachers._ray' not in sys.modules\n"
        "assert 'groupflow.impl._core._tq_store' not in sys.modules\n"
        + "".join(f"assert groupflow.impl.{name} is not None\n" for name in LAZY_WITHOUT_TORCH)
        + "from groupflow.impl import RaySettings, ray_session\n"
        "from groupflow.impl.errors import Unavailable\n"
        "try:\n"
        "    ray_session(RaySettings()).__enter__()\n"
        "except Unavailable as e:\n"
        "    assert 'groupflow[ray]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('ray_session started without Ray')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _docs_code() -> list[str]:
    return [
        block
        for page in user_pages()
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    ]


def test_the_docs_examples_import_only_the_public_api() -> None:
    """A block in the README or a docs page imports from `groupflow.impl` or one of its public
    subpackages, and only names that module exports."""
    blocks = _docs_code()
    assert blocks
    imported = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "groupflow.impl"
            ):
                module = node.module or ""
                assert module == "groupflow.impl" or (
                    module.split(".")[2] in SUBPACKAGES + TIERS and module.count(".") == 2
                ), module
                exported = set(importlib.import_module(module).__all__)
                if module == "groupflow.impl":  # `from groupflow.impl import aio`
                    exported |= set(TIERS)
                assert {a.name for a in node.names} <= exported, (module, node.names)
                imported += [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("groupflow.impl.") for a in node.names)
    assert imported


def test_the_docs_name_no_private_module() -> None:
    """Where the README or a docs page names a path under `groupflow.impl`, it is public."""
    text = "\n".join(page.read_text(encoding="utf-8") for page in user_pages())
    for path in sorted(set(re.findall(r"groupflow\.impl(?:\.\w+)+", text))):
        parts = path.split(".")
        assert not any(p.startswith("_") for p in parts), path
        obj: object = groupflow.impl
        for i, part in enumerate(parts[2:], start=2):
            if not hasattr(obj, part):
                importlib.import_module(".".join(parts[: i + 1]))
            obj = getattr(obj, part)
