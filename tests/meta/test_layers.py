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
    "impl._core": frozenset({"model", "impl._core"}),
    "impl.contract": frozenset({"model", "impl._core", "impl.contract"}),
    "impl._pipeline": frozenset({"model", "impl._core", "impl.contract", "impl._pipeline"}),
    "impl._teachers": frozenset(
        {"model", "impl._core", "impl.contract", "impl._pipeline", "impl._teachers"}
    ),
    "impl.engines": frozenset(
        {"model", "impl._core", "impl.contract", "impl._pipeline", "impl._teachers", "impl.engines"}
    ),
    "impl._trainer": frozenset(
        {
            "model",
            "impl._core",
            "impl.contract",
            "impl._pipeline",
            "impl._teachers",
            "impl.engines",
            "impl._trainer",
        }
    ),
    "impl.testing": frozenset(
        {"model", "impl._core", "impl.contract", "impl._pipeline", "impl.testing"}
    ),
    "impl.aio": frozenset(
        {"model", "impl._core", "impl.contract", "impl._pipeline", "impl._teachers", "impl.aio"}
    ),
    "impl": frozenset(
        {
            "model",
            "impl._core",
            "impl.contract",
            "impl._pipeline",
            "impl._teachers",
            "impl.engines",
            "impl",
        }
    ),
    "sim.verify": frozenset(
        {"model", "impl._core", "impl.contract", "impl._pipeline", "sim.verify"}
    ),
    "sim": frozenset(
        {
            "sim.verify",
            "model",
            "impl._core",
            "impl._pipeline",
            "impl.contract",
            "impl._teachers",
            "impl.engines",
            "impl._trainer",
            "impl.aio",
            "impl.testing",
            "impl",
            "sim",
        }
    ),
    "properties": frozenset(
        {
            "model",
            "impl._core",
            "impl._pipeline",
            "impl.contract",
            "impl._teachers",
            "impl.engines",
            "impl._trainer",
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
            "impl._core",
            "impl._pipeline",
            "impl.contract",
            "impl._teachers",
            "impl.engines",
            "impl._trainer",
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
    "groupflow.impl._teachers._torch": {"torch"},
    "groupflow.impl._teachers._hf": {"torch"},
    "groupflow.impl._teachers._served_lm": {"torch"},
    "groupflow.impl._trainer._domain_teachers": {"torch"},
    "groupflow.impl._trainer._greedy": {"torch"},
    "groupflow.impl._trainer._student": {"torch"},
    "groupflow.impl._trainer._generator": {"torch"},
    "groupflow.impl._trainer._learner": {"torch"},
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


def _groupflow_imports() -> Iterator[tuple[str, str, int, bool]]:
    """(importing module, groupflow module imported, line, at top level) for the package."""
    for module, path in MODULES.items():
        for imported, line, at_top in _imports(path):
            if imported.startswith("groupflow."):
                yield module, imported, line, at_top


def test_the_walk_sees_every_layer() -> None:
    assert {_layer(m) for m in MODULES} == set(MAY_IMPORT)
    assert len(MODULES) > 50


def test_no_import_runs_back_up_the_layers() -> None:
    wrong = [
        f"{module} (line {line}) imports {imported}"
        for module, imported, line, _ in _groupflow_imports()
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


EXTRAS_MAY_SPREAD = ("groupflow.impl._trainer._", "groupflow.impl._teachers._")
"""Where a module may import an extra through another module at its top: the private modules
of the trainer and the teacher backends, which the packages above import where they use them."""


def _needs_extras() -> set[str]:
    """Modules that import an extra when imported: those in HEAVY_AT_TOP, and those that import
    one of them at their top."""
    needs = set(HEAVY_AT_TOP)
    top = [(m, i) for m, i, _, at_top in _groupflow_imports() if at_top]
    while grown := {m for m, i in top if i in needs and m not in needs}:
        needs |= grown
    return needs


def test_subpackages_import_each_other_through_their_public_names() -> None:
    """A module reaches into another subpackage through its `__init__`. A private module of
    another subpackage (`_run`, `_torch`: one that needs torch or another extra) is imported
    where it is used (inside a function, or under TYPE_CHECKING), unless the importer needs
    extras itself; so importing a subpackage never imports an extra."""
    needs = _needs_extras()
    beyond = {m for m in needs - set(HEAVY_AT_TOP) if not m.startswith(EXTRAS_MAY_SPREAD)}
    assert beyond == set(), "these import an extra at their top, through another module"
    wrong = []
    for module, imported, line, at_top in _groupflow_imports():
        layer = _layer(imported)
        inside = imported.split(".")[1 + len(layer.split(".")) :]
        if module in PATCH_INTERNALS or layer == _layer(module) or module in needs:
            continue
        if at_top and any(part.startswith("_") for part in inside):
            wrong.append(f"{module} (line {line}) imports {imported}")
    assert wrong == []


def test_nothing_inside_impl_imports_the_facade() -> None:
    """`groupflow.impl` imports its subpackages; one importing it back would be a cycle."""
    wrong = [
        f"{module} (line {line})"
        for module, imported, line, _ in _groupflow_imports()
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
