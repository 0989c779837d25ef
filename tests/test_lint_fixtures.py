"""Lint rules against the fixture files beside them (tests/lint_fixtures/, format in its
README.md): every ``*-fail`` file reports what its ``# expect:`` header says, where it says, every
``*-pass`` file does not report what its ``# absent:`` header names, and every registered rule has
both. A new case is a new file."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import geomopt
from geomopt.lint import lint_spec
from geomopt.lint import RULES

HERE = Path(__file__).resolve().parent / "lint_fixtures"
FILES = sorted([*HERE.glob("*.yaml"), *HERE.glob("*.geom")])
NAME = re.compile(r"(?P<code>GO\d{3})(?:-[a-z0-9-]+)?-(?P<kind>fail|pass)\.(?:yaml|geom)")
HEADER = re.compile(r"#\s*(?P<key>expect|absent|target|message|select|ignore)\s*:\s*(?P<value>.*?)\s*$")


@dataclass
class Fixture:
    path: Path
    code: str  # the rule the file is for (its name's code)
    kind: str  # "fail" or "pass"
    expect: list = field(default_factory=list)  # (code, "line:col")
    absent: list = field(default_factory=list)
    target: str = "none"
    messages: list = field(default_factory=list)
    select: str | None = None
    ignore: str | None = None


def read_fixture(path: Path) -> Fixture:
    """The header: the file's leading ``# key: value`` lines (README.md)."""
    m = NAME.fullmatch(path.name)
    assert m, f"{path.name}: name it CODE[-variant]-fail|pass.yaml|geom"
    fx = Fixture(path, m["code"], m["kind"])
    for line in path.read_text(encoding="utf-8").splitlines():
        h = HEADER.match(line)
        if not h:
            break
        key, value = h["key"], h["value"]
        if key == "expect":
            code, at = value.split()
            assert re.fullmatch(r"\d+:\d+", at), f"{path.name}: expect CODE LINE:COL"
            fx.expect.append((code, at))
        elif key == "absent":
            fx.absent += [c.strip() for c in value.split(",") if c.strip()]
        elif key == "message":
            fx.messages.append(value)
        else:
            setattr(fx, key, value)
    return fx


FIXTURES = [read_fixture(p) for p in FILES]


def _fixture_models():
    spec = importlib.util.spec_from_file_location("lint_fixture_models", HERE / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: (ParamInfos or None, from a checkpoint) for a ``# target:`` value (lint_fixtures/models.py)
target_params = _fixture_models().target_params


def lint_fixture(fx: Fixture):
    params, from_ckpt = target_params(fx.target)
    spec = geomopt.load_spec(fx.path)
    return lint_spec(spec, params, from_checkpoint=from_ckpt, select=fx.select, ignore=fx.ignore)


@pytest.mark.parametrize("fx", FIXTURES, ids=[f.path.name for f in FIXTURES])
def test_fixture(fx: Fixture):
    diags = lint_fixture(fx)
    shown = [d.format() for d in diags]
    for code, at in fx.expect:
        found = [d for d in diags if d.code == code and f"{d.line}:{d.col}" == at]
        assert found, (code, at, shown)
        rule = RULES[code]
        assert all((d.name, d.severity, d.file) == (rule.name, rule.severity, str(fx.path)) and d.message for d in found)
    text = " ".join(d.message for d in diags if d.code == fx.code)
    for m in fx.messages:
        assert m in text, (m, shown)
    assert not {d.code for d in diags} & set(fx.absent), shown


@pytest.mark.parametrize("fx", FIXTURES, ids=[f.path.name for f in FIXTURES])
def test_fixture_header_fits_its_name(fx: Fixture):
    assert fx.code in RULES, f"{fx.path.name}: no rule {fx.code}"
    if fx.kind == "fail":
        assert fx.code in {c for c, _ in fx.expect}, f"{fx.path.name}: a fail fixture expects its own code"
    else:
        assert fx.code in fx.absent, f"{fx.path.name}: a pass fixture names its own code as absent"
    assert all(c in RULES for c, _ in fx.expect) and all(c in RULES for c in fx.absent)
    assert fx.path.read_text(encoding="utf-8").startswith("# expect: " if fx.kind == "fail" else "# absent: ")


def test_every_rule_has_a_failing_and_a_passing_fixture():
    kinds = {(f.code, f.kind) for f in FIXTURES}
    missing = [f"{code}-{kind}" for code in sorted(RULES) for kind in ("fail", "pass") if (code, kind) not in kinds]
    assert not missing, missing


def test_fixtures_cover_both_spellings():
    assert {f.path.suffix for f in FIXTURES} == {".yaml", ".geom"}
    assert {"GO101", "GO105", "GO123"} <= {f.code for f in FIXTURES if f.path.suffix == ".geom"}
