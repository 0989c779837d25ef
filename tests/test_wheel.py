"""The wheel: built offline from a copy of the checkout, it carries every module and, inside the package,
the top-level specs/ and grammars/; installed into a bare folder, it loads the shipped specs by name and
parses the DSL with its grammar, with no checkout in sight. Also where the package looks for both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from geomopt.spec import shipped
from geomopt.spec.extends import shipped_specs

ROOT = Path(__file__).resolve().parents[1]

# run in the installed copy by an interpreter without site (no .pth: no editable install of the checkout)
PROBE = """
import json, sys
from pathlib import Path
import geomopt
from geomopt.spec.shipped import shipped_folder
target = Path(sys.argv[1]).resolve()
names = geomopt.shipped_specs()
muon = geomopt.load_spec("muon")
dsl = geomopt.parse_spec(names["muon"].with_suffix(".geom").read_text(encoding="utf-8"), "dsl")
print(json.dumps({
    "module": str(Path(geomopt.__file__).resolve().relative_to(target)),
    "folders": [str(shipped_folder(f).relative_to(target)) for f in ("specs", "grammars")],
    "names": sorted(names),
    "outside": [str(p) for p in names.values() if not p.resolve().is_relative_to(target)],
    "lion": geomopt.load_spec("lion").name,
    "dsl_is_yaml": dsl == muon,
    "rules": [r.name for r in dsl.rules],
}))
"""


def _pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _expected_files() -> set[str]:
    """What the wheel must hold under geomopt/: the modules, py.typed, and specs/ and grammars/ moved in."""
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "geomopt").rglob("*.py") if "__pycache__" not in p.parts}
    data = {"geomopt/" + p.relative_to(ROOT).as_posix()
            for folder in ("specs", "grammars") for p in (ROOT / folder).rglob("*") if p.is_file()}
    return modules | data | {"geomopt/py.typed"}


def test_wheel_ships_specs_and_grammar(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind, whose stale files ship
    for name in ("geomopt", "specs", "grammars"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _pip("wheel", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("geomopt-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        files = {n for n in zf.namelist() if n.startswith("geomopt/")}
    expected = _expected_files()
    assert "geomopt/specs/catalog/lion.yaml" in files and "geomopt/grammars/geomopt.lark" in files
    assert files == expected, {"missing (list the package in pyproject.toml)": sorted(expected - files),
                               "unexpected": sorted(files - expected)}

    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(wheel), cwd=tmp_path)
    deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]  # torch, pydantic, lark, …
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *deps])}
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE, str(target)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["module"] == os.path.join("geomopt", "__init__.py")
    assert got["folders"] == [os.path.join("geomopt", "specs"), os.path.join("geomopt", "grammars")]
    assert got["names"] == sorted(shipped_specs()) and "muon" in got["names"]
    assert got["outside"] == [] and got["lion"] == "lion"
    assert got["dsl_is_yaml"] is True and got["rules"] == ["hidden", "embeddings", "head", "rest"]


def test_checkout_reads_the_top_level_folders():
    assert shipped.shipped_folder("specs") == ROOT / "specs"
    assert shipped.shipped_folder("grammars") == ROOT / "grammars"
    assert shipped_specs()["muon"] == ROOT / "specs" / "muon.yaml"


def test_installed_folder_first_and_a_missing_one_named(tmp_path, monkeypatch):
    package = tmp_path / "geomopt"
    (package / "specs").mkdir(parents=True)
    (tmp_path / "specs").mkdir()
    monkeypatch.setattr(shipped, "PACKAGE", package)
    assert shipped.shipped_folder("specs") == package / "specs"
    with pytest.raises(FileNotFoundError, match=r"shipped grammars/ folder is missing.*reinstall geomopt"):
        shipped.shipped_folder("grammars")
