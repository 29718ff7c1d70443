"""The wheel must carry every folder of the package: setuptools finds no mapped subpackage by itself."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT


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
        "groupflow.cli": "cli",
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
    assert "groupflow = groupflow.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


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


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _deprecations(source: str) -> list[tuple[int, str]]:
    """(line, `removed_in`) of every `deprecated(...)` call in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "deprecated":
            for keyword in node.keywords:
                if keyword.arg == "removed_in" and isinstance(keyword.value, ast.Constant):
                    found.append((node.lineno, str(keyword.value.value)))
    return found


def _overdue(version: str, sources: dict[str, str]) -> list[str]:
    return [
        f"{name}:{line} goes away in {removed_in}"
        for name, source in sources.items()
        for line, removed_in in _deprecations(source)
        if _version(version) >= _version(removed_in)
    ]


def test_no_deprecation_outlives_the_release_it_names() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sources = {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for folder in ("model", "impl", "sim", "properties")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert not _overdue(version, sources)
    # the check itself: a call past its release is found, one before it is not
    call = 'deprecated("x", removed_in="{}", instead="y")\n'
    assert _overdue("0.3.0", {"m.py": call.format("0.3.0")}) == ["m.py:1 goes away in 0.3.0"]
    assert not _overdue("0.2.9", {"m.py": call.format("0.3.0")})


def test_a_deprecation_says_what_to_use_and_when_it_goes() -> None:
    from groupflow.impl._core import GroupflowDeprecationWarning, deprecated

    def old() -> None:
        deprecated("old()", removed_in="0.3.0", instead="new()")

    with pytest.warns(GroupflowDeprecationWarning) as caught:
        old()
    assert str(caught[0].message) == (
        "old() is deprecated and goes away in groupflow 0.3.0: use new()"
    )
    assert caught[0].filename == __file__, "the warning points at the caller of old()"


def test_the_changelog_starts_at_the_packages_version() -> None:
    """The newest release the changelog names is the package's version; changes since then
    are listed above it, under "Unreleased"."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = [line for line in changelog.splitlines() if line.startswith("## ")]
    releases = [h for h in headings if h != "## Unreleased"]
    assert headings[0] in ("## Unreleased", releases[0]), headings[0]
    assert releases[0].startswith(f"## {version} "), releases[0]
