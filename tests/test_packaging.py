"""The wheel must carry every folder of the package: setuptools finds no mapped subpackage by itself."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _package_folders() -> dict[str, Path]:
    """Every folder holding Python code under a mapped top-level folder, by the package name it must have."""
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    found = {}
    for top_package, folder in mapping.items():
        base = ROOT / folder
        for path in [base, *sorted(p for p in base.rglob("*") if p.is_dir())]:
            if "__pycache__" in path.parts or not any(path.glob("*.py")):
                continue
            rel = path.relative_to(base).parts
            found[".".join([top_package, *rel])] = path
    return found


def test_declared_packages_match_folders() -> None:
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = set(_package_folders())
    assert on_disk - declared == set(), "folders with code missing from [tool.setuptools] packages"
    assert declared - on_disk == set(), "packages declared without a folder"


def test_every_package_has_init_and_py_typed() -> None:
    for name, path in _package_folders().items():
        assert (path / "__init__.py").is_file(), f"{name}: {path} has no __init__.py"
        assert (path / "py.typed").is_file(), f"{name}: {path} has no py.typed"


def test_top_level_folders_are_the_layout() -> None:
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert mapping == {
        "groupflow.model": "model",
        "groupflow.impl": "impl",
        "groupflow.sim": "sim",
        "groupflow.properties": "properties",
    }


@pytest.mark.parametrize("name", sorted(_package_folders()))
def test_declared_packages_import(name: str) -> None:
    importlib.import_module(name)


def test_model_is_pure() -> None:
    """groupflow.model imports neither trio nor torch, nor impl/sim: checked in a fresh interpreter."""
    code = (
        "import sys, groupflow.model\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'trio', 'torch', 'numpy'} "
        "or m.startswith(('groupflow.impl', 'groupflow.sim', 'groupflow.properties')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_wheel_contains_every_module(tmp_path: Path) -> None:
    """`pip install .` gets what `pip install -e .` gets: build the wheel and list it."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("groupflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, folder in _package_folders().items():
        prefix = package.replace(".", "/")
        for module in folder.glob("*.py"):
            assert f"{prefix}/{module.name}" in names, f"wheel lacks {prefix}/{module.name}"
        assert f"{prefix}/py.typed" in names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    for scenario in (ROOT / "sim" / "scenarios").glob("*.toml"):
        assert f"groupflow/sim/scenarios/{scenario.name}" in names, f"wheel lacks {scenario.name}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "groupflow.sim.cmd_sim" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_typecheck_tree_links_every_folder() -> None:
    """mypy reads the package through `.typecheck/groupflow`: one symlink per mapped folder."""
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    tree = ROOT / ".typecheck" / "groupflow"
    links = {p.name: p for p in tree.iterdir()}
    assert set(links) == {package.split(".")[1] for package in mapping}
    for package, folder in mapping.items():
        link = links[package.split(".")[1]]
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link
    mypy = _pyproject()["tool"]["mypy"]
    assert mypy["mypy_path"] == ".typecheck"
    assert ".typecheck/groupflow" in mypy["files"]
