"""Suppression comments (``# geomopt: disable=CODE``, ``disable-file``; GO123), rule selection
(``select=`` / ``ignore=``, ``geomopt lint --select … --ignore …``), the shipped specs passing
``geomopt lint --strict``, and the layout of the geomopt.lint package. Per-rule cases, suppressed
ones included, are fixture files (tests/lint_fixtures/)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.lint import lint_spec
from geomopt.compile.blocking import BLOCKING
from geomopt.compile.compiler import model_params
from geomopt.lint import REPORTERS, RULES, selected_codes
from geomopt.lint.suppress import directives
from geomopt.models import MODELS, SmallCNN
from geomopt.spec.diagnostics import SpecError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "specs"
GO107 = ("geomopt: 1\nname: t\nrules:\n  - name: hidden\n    match: \"**\"\n    geometry:\n      kind: spectral\n"
         "      reference: {kind: log_barrier}{COMMENT}\n      approx: {kind: polar_express, steps: 5}\n"
         "    constraint: {kind: frobenius_ball, radius: 1.0}\n")  # GO107 at 8:18


def _codes(diags) -> list[str]:
    return [d.code for d in diags]


# ---------------------------------------------------------------- every shipped spec passes --strict


def test_lint_strict_passes_on_every_shipped_spec(capsys):
    """The spec alone (the example that warns on purpose carries a suppression with its reason)."""
    assert main(["lint", "--strict", str(SHIPPED)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "GO107" not in out and "GO123" not in out


@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt"])
def test_lint_strict_passes_on_the_recipes_and_the_catalog_against_the_test_models(model, capsys):
    specs = sorted(str(p) for p in [*SHIPPED.glob("*.yaml"), *SHIPPED.glob("*.geom"), *(SHIPPED / "catalog").glob("*.yaml")])
    assert main(["lint", "--strict", "--model", model, *specs]) == 0, capsys.readouterr().out


def _grokking_net():
    before = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("grokking_example", ROOT / "examples" / "grokking.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = before
    return module.GrokNet(module.P, 32, 2, 4, 0.0)


def test_example_specs_lint_strict_clean_against_their_own_models():
    models = {"digits": lambda: SmallCNN(in_channels=1, width=8, n_classes=10), "grokking": _grokking_net}
    paths = sorted((SHIPPED / "examples").glob("*.yaml"))
    assert paths
    for path in paths:
        model = models.get(path.name.split("-")[0], MODELS["gpt"])()
        diags = lint_spec(geomopt.load_spec(path), model_params(model)[0])
        assert not [d.format() for d in diags if d.severity != "note"], path.name


def test_the_intended_warning_is_suppressed_with_a_reason():
    path = SHIPPED / "examples" / "digits-frobenius-euclidean.yaml"
    line = next(t for t in path.read_text(encoding="utf-8").splitlines() if "geomopt: disable=" in t)
    assert "disable=GO107 -- " in line and line.split("--", 1)[1].strip()
    spec = geomopt.load_spec(path)
    assert "GO107" not in _codes(lint_spec(spec))
    assert "GO107" in _codes(lint_spec(spec, text=path.read_text(encoding="utf-8").replace("disable=", "ignore=")))


# ---------------------------------------------------------------- suppression comments


def test_directives_are_comments_only():
    text = ('geomopt: 1  # geomopt: disable=GO107, GO109 -- two codes\nname: "a # geomopt: disable=GO108"\n'
            "# a reason\n# geomopt: disable=outside-theory\n\n# geomopt: disable-file=GO121\nrules: []\n")
    found = directives(text, "yaml")
    assert [(d.line, d.col, d.target, d.codes) for d in found] == [
        (1, 13, 1, ["GO107", "GO109"]), (4, 1, 5, ["outside-theory"]), (6, 1, 0, ["GO121"])]
    dsl = 'geomopt 1\nname "x # geomopt: disable=GO109"\n# geomopt: disable=GO109\nrule a match "**":\n'
    assert [(d.line, d.target) for d in directives(dsl, "dsl")] == [(3, 4)]
    assert directives("geomopt: 1\n", "yaml") == []


def test_a_spec_given_as_text_is_suppressed_when_its_text_is_given():
    text = GO107.replace("{COMMENT}", "  # geomopt: disable=GO107")
    spec = geomopt.parse_spec(text)
    assert "GO107" in _codes(lint_spec(spec))  # no file to read the comments from
    assert _codes(lint_spec(spec, text=text)) == []


def test_suppression_of_a_blocking_error_is_refused_and_says_so(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text('geomopt: 1\nname: t\nrules:\n  - name: all\n    match: "**"\n'
                    "    geometry: {kind: spectral, reference: {kind: indicator}}\n"
                    "    constraint: {kind: l0, k: 3}  # geomopt: disable=GO105\n", encoding="utf-8")
    diags = lint_spec(geomopt.load_spec(path))
    (error,) = [d for d in diags if d.code == "GO105"]
    assert "not suppressed: a blocking error; the suppression at 7:35 does not apply" in error.message
    (note,) = [d for d in diags if d.code == "GO123"]
    assert (note.line, note.col, note.severity) == (7, 35, "note") and "cannot be suppressed" in note.message
    with pytest.raises(SpecError, match="GO105"):  # compile refuses it all the same
        compile_spec(path, MODELS["mlp"]())
    assert set(BLOCKING) <= set(RULES)


def test_an_extending_spec_suppresses_inherited_findings_at_its_extends(tmp_path):
    path = tmp_path / "hybrid.yaml"
    path.write_text("geomopt: 1\nname: mine\nextends: adamw-hybrid\n", encoding="utf-8")
    assert "GO109" in _codes(lint_spec(geomopt.load_spec(path)))
    path.write_text("geomopt: 1\nname: mine\nextends: adamw-hybrid  # geomopt: disable=GO109\n", encoding="utf-8")
    assert _codes(lint_spec(geomopt.load_spec(path))) == []


def test_unused_suppression_notes_can_be_ignored_or_suppressed(tmp_path):
    path = tmp_path / "s.yaml"
    body = 'geomopt: 1\nname: t\nrules:\n  - {name: all, match: "**", geometry: {kind: euclidean}}  # geomopt: disable=GO109\n'
    path.write_text(body, encoding="utf-8")
    assert _codes(lint_spec(geomopt.load_spec(path))) == ["GO123"]
    assert _codes(lint_spec(geomopt.load_spec(path), ignore="GO123")) == []
    assert _codes(lint_spec(geomopt.load_spec(path), select="GO107")) == []  # GO109 did not run: not "unused"
    path.write_text("# geomopt: disable-file=GO123\n" + body, encoding="utf-8")
    assert _codes(lint_spec(geomopt.load_spec(path))) == []


# ---------------------------------------------------------------- select / ignore


@pytest.mark.parametrize("select, ignore, expected", [
    ("GO1", "GO109", set(RULES) - {"GO109"}),
    ("GO107", "GO1", {"GO107"}),  # the more specific selector wins
    ("GO10", "GO10", set()),  # a tie: ignore wins
    (["GO101, GO102", "unused-rule"], None, {"GO101", "GO102"}),
    ("reference-approx-mismatch", None, {"GO107"}),
    (None, "ALL", set()),
    ("all", "GO11,GO12", {c for c in RULES if c.startswith("GO10")}),
    ("go12", None, {c for c in RULES if c.startswith("GO12")}),
])
def test_selection(select, ignore, expected):
    assert selected_codes(select, ignore) == frozenset(expected)


def test_selection_default_is_every_rule():
    assert selected_codes() is None
    assert selected_codes(ignore=[]) == frozenset(RULES)


@pytest.mark.parametrize("bad, message", [("GO9", "unknown rule selector 'GO9'"), ("GO0", "always reported"),
                                          ("unused-rul", "did you mean 'unused-rule'"), ("E501", "unknown")])
def test_a_selector_matching_no_rule_is_an_error(bad, message):
    with pytest.raises(ValueError, match=message):
        selected_codes(select=bad)
    with pytest.raises(ValueError, match=message):
        lint_spec(geomopt.parse_spec(GO107.replace("{COMMENT}", "")), ignore=bad)


def test_cli_select_and_ignore(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(GO107.replace("{COMMENT}", "").replace("kind: log_barrier}", "kind: log_barrier, eps: 1.0e-20}"),
                    encoding="utf-8")
    assert main(["lint", str(path), "--format", "json"]) == 0
    assert {d["code"] for d in json.loads(capsys.readouterr().out)} == {"GO106", "GO107"}
    assert main(["lint", str(path), "--format", "json", "--select", "GO1", "--ignore", "GO106"]) == 0
    assert {d["code"] for d in json.loads(capsys.readouterr().out)} == {"GO107"}
    assert main(["lint", str(path), "--strict", "--select", "GO107", "--ignore", "GO1"]) == 1
    capsys.readouterr()
    assert main(["lint", str(path), "--strict", "--select", "GO106,GO107", "--select", "dubious-value",
                 "--ignore", "reference-approx-mismatch", "--format", "json"]) == 1
    assert {d["code"] for d in json.loads(capsys.readouterr().out)} == {"GO106"}
    assert main(["lint", str(path), "--select", "GO9"]) == 2
    assert "unknown rule selector 'GO9'" in capsys.readouterr().err


# ---------------------------------------------------------------- the package


def test_reporters_are_registered_and_the_cli_uses_them():
    from geomopt.cli import main as cli

    assert list(REPORTERS) == ["text", "json", "github"]
    assert cli.report.__module__ == "geomopt.lint.reporters"
    assert not hasattr(cli, "json_report")


def test_rules_registry_keeps_each_rules_meta():
    for code, rule in RULES.items():
        assert RULES.meta[code] == {"code": code, "name": rule.name, "severity": rule.severity,
                                    "needs_model": rule.needs_model}
    with pytest.raises(ValueError, match="registered twice"):
        from geomopt.lint import lint_rule

        lint_rule("GO107", "again", "warning")(lambda ctx: ())


def test_package_layout():
    assert importlib.util.find_spec("geomopt.compile.lint") is None  # no shim left behind
    for path in sorted((ROOT / "geomopt" / "lint").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 450, path.name
        assert text.lstrip().startswith('"""'), f"{path.name} needs a docstring"


@pytest.mark.parametrize("first", ["geomopt.lint", "geomopt.compile", "geomopt.compile.compiler", "geomopt.cli.main"])
def test_either_package_may_be_imported_first(first):
    code = (f"import {first}; import geomopt.compile, geomopt.lint; "
            "assert len(geomopt.lint.RULES) >= 23 and "
            "set(geomopt.compile.blocking.BLOCKING) <= set(geomopt.lint.RULES)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
