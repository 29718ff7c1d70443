"""Dependencies point one way: model <- impl core <- pipeline <- teachers <- engines, trainer
<- sim (its run verifier, `sim.verify`, on the model and the pipeline alone) <- properties <-
cli. Read from every module's imports (its syntax tree, imports inside functions and
under TYPE_CHECKING included), so a lazy import running back up is caught too."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

MAY_IMPORT: dict[str, frozenset[str]] = {
    "model": frozenset({"model"}),
    "impl.core": frozenset({"model", "impl.core"}),
    "impl.pipeline": frozenset({"model", "impl.core", "impl.pipeline"}),
    "impl.teachers": frozenset({"model", "impl.core", "impl.pipeline", "impl.teachers"}),
    "impl.engines": frozenset(
        {"model", "impl.core", "impl.pipeline", "impl.teachers", "impl.engines"}
    ),
    "impl.trainer": frozenset(
        {"model", "impl.core", "impl.pipeline", "impl.teachers", "impl.engines", "impl.trainer"}
    ),
    "impl.testing": frozenset({"model", "impl.core", "impl.pipeline", "impl.testing"}),
    "impl.aio": frozenset({"model", "impl.core", "impl.pipeline", "impl.teachers", "impl.aio"}),
    "impl": frozenset(
        {"model", "impl.core", "impl.pipeline", "impl.teachers", "impl.engines", "impl"}
    ),
    "sim.verify": frozenset({"model", "impl.core", "impl.pipeline", "sim.verify"}),
    "sim": frozenset(
        {
            "sim.verify",
            "model",
            "impl.core",
            "impl.pipeline",
            "impl.teachers",
            "impl.engines",
            "impl.trainer",
            "impl.aio",
            "impl.testing",
            "impl",
            "sim",
        }
    ),
    "properties": frozenset(
        {
            "model",
            "impl.core",
            "impl.pipeline",
            "impl.teachers",
            "impl.engines",
            "impl.trainer",
            "impl.aio",
            "impl.testing",
            "impl",
            "sim",
            "sim.verify",
            "properties",
        }
    ),
    "cli": frozenset(
        {
            "model",
            "impl.core",
            "impl.pipeline",
            "impl.teachers",
            "impl.engines",
            "impl.trainer",
            "impl.aio",
            "impl.testing",
            "impl",
            "sim",
            "sim.verify",
            "properties",
            "cli",
        }
    ),
}
"""Each layer and the layers it may import from. `impl` is `groupflow.impl` itself, the facade
that exports what users call; the command line (`cli`) sits above everything it drives."""

HEAVY = {"torch", "transformers", "hypothesis", "matplotlib"}
HEAVY_AT_TOP = {
    "groupflow.impl.teachers._torch": {"torch"},
    "groupflow.impl.teachers._hf": {"torch"},
    "groupflow.impl.teachers._served_lm": {"torch"},
    "groupflow.impl.trainer._domain_teachers": {"torch"},
    "groupflow.impl.trainer._greedy": {"torch"},
    "groupflow.impl.trainer._student": {"torch"},
    "groupflow.impl.trainer._generator": {"torch"},
    "groupflow.impl.trainer._learner": {"torch"},
    "groupflow.properties.budget": {"hypothesis"},
    "groupflow.properties.buffer_machine": {"hypothesis"},
    "groupflow.properties.pipeline_machine": {"hypothesis"},
    "groupflow.properties.pipeline_setups": {"hypothesis"},
    "groupflow.properties.scheduler_machine": {"hypothesis"},
    "groupflow.properties.served_machine": {"hypothesis"},
}
"""The only modules that import an optional dependency when they are imported; everything else
imports them where they are used, so a plain install imports every package."""


def _modules() -> Iterator[tuple[str, Path]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


MODULES = dict(_modules())


def _layer(module: str) -> str:
    """The layer of a groupflow module: `model`, `impl.core`, ..., `impl` for the facade."""
    parts = module.split(".")[1:]
    if parts[0] in ("impl", "sim") and len(parts) > 1 and f"{parts[0]}.{parts[1]}" in MAY_IMPORT:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(module imported, line, at top level) for every import in a file; `from P import N`
    yields `P.N` when N is a module, else `P`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                yield (name if name in MODULES else node.module), node.lineno, id(node) in top


def _groupflow_imports() -> Iterator[tuple[str, str, int]]:
    for module, path in MODULES.items():
        for imported, line, _ in _imports(path):
            if imported.startswith("groupflow."):
                yield module, imported, line


def test_the_walk_sees_every_layer() -> None:
    assert {_layer(m) for m in MODULES} == set(MAY_IMPORT)
    assert len(MODULES) > 50


def test_no_import_runs_back_up_the_layers() -> None:
    wrong = [
        f"{module} (line {line}) imports {imported}"
        for module, imported, line in _groupflow_imports()
        if _layer(imported) not in MAY_IMPORT[_layer(module)]
    ]
    assert wrong == []


PATCH_INTERNALS = frozenset(
    {
        "groupflow.properties.pipeline_bugs",
        "groupflow.properties.served_bugs",
        "groupflow.properties.aio_bugs",
    }
)
"""Modules whose job is to patch private functions: the seeded bugs."""


def test_subpackages_import_each_other_through_their_public_names() -> None:
    """A module reaches into another subpackage only through its `__init__`; private modules
    (`_buffer`, `_rollout`, ...) are seen from their own subpackage only."""
    wrong = []
    for module, imported, line in _groupflow_imports():
        private = [p for p in imported.split(".") if p.startswith("_")]
        if module in PATCH_INTERNALS:
            continue
        if private and _layer(imported) != _layer(module):
            wrong.append(f"{module} (line {line}) imports {imported}")
    assert wrong == []


def test_nothing_inside_impl_imports_the_facade() -> None:
    """`groupflow.impl` imports its subpackages; one importing it back would be a cycle."""
    wrong = [
        f"{module} (line {line})"
        for module, imported, line in _groupflow_imports()
        if imported == "groupflow.impl" and _layer(module).startswith("impl.")
    ]
    assert wrong == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_optional_dependencies_are_imported_where_they_are_used(module: str) -> None:
    at_top = {
        imported.split(".")[0]
        for imported, _, top in _imports(MODULES[module])
        if top and imported.split(".")[0] in HEAVY
    }
    assert at_top == HEAVY_AT_TOP.get(module, set())
