"""The package's layout stays one the next engineer can carry: no module over 450 lines, every
module with a docstring, no symbolic link at the repository root."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "geomopt").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_is_short_and_says_what_it_holds(path):
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= 450, f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines; split it by concept"
    assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} has no module docstring"


def test_no_symlink_at_the_repository_root():
    assert not [p.name for p in ROOT.iterdir() if p.is_symlink()]


def test_every_spec_folder_ships_with_the_package():
    """The wheel carries every spec the docs and examples name by path: each folder under specs/ is a
    package of its own, with all its files as package data (tests/test_wheel.py builds the wheel)."""
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11 (this project's CI and machines)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "specs").rglob("*.yaml")}
    packages = {"geomopt." + folder.replace("/", ".") for folder in folders}
    assert "geomopt.specs.catalog" in packages and packages <= set(setuptools["packages"]), (packages, setuptools)
    assert all(setuptools["package-data"][p] == ["*"] for p in packages), setuptools["package-data"]
    assert setuptools["package-dir"] == {"geomopt.specs": "specs", "geomopt.grammars": "grammars"}
