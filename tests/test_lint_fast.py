"""`geomopt lint` as a fast linter: no torch without a model, large specs through libyaml's events
with the same data and positions as the pure-Python loader, and the torch-free operator support table
(geomopt.support) in step with the registered operators. Nothing here is timed
(benchmarks/lint.py measures)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geomopt import support
from geomopt.lint import lint_spec
from geomopt.spec import yaml_front
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.validate import parse_spec

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "specs").glob("*.geom"))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_lint", ROOT / "benchmarks" / "lint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- no torch without a model

_NO_TORCH = """
import json, runpy, sys
sys.argv = ["geomopt", "lint", *sys.argv[1:]]
try:
    runpy.run_module("geomopt", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_lint_without_a_model_imports_no_torch():
    """Every shipped spec, both spellings, linted in one fresh process (the entry point as the
    `geomopt` command runs it): the operator metadata lint reads is plain data (prox-muon-frobenius
    has the spectral approximation and h-dependent constraint GO107 checks)."""
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *map(str, SHIPPED)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["code"] == 0, proc.stdout
    assert result["torch"] == []
    assert any("muon.geom" in line and "GO109" in line for line in proc.stdout.splitlines())  # linted, both spellings
    assert any("muon.yaml" in line and "GO109" in line for line in proc.stdout.splitlines())


# ---------------------------------------------------------------- large specs


def _reference(text: str, fmt: str, monkeypatch):
    """parse_spec with the pure-Python YAML loader only (the fast path stepped aside)."""
    def never(text, source):
        raise yaml_front._Fallback

    with monkeypatch.context() as m:
        m.setattr(yaml_front, "_load_fast", never)
        try:
            return parse_spec(text, fmt, file="big")
        except SpecError as exc:
            return exc


@pytest.mark.parametrize("fmt", ["yaml", "dsl"])
def test_large_spec_reports_an_error_near_its_end_where_it_is(fmt, monkeypatch):
    bench = _bench()
    bad = ("  - name: late\n    match: \"late.weight\"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n"
           "    lr: -1.0\n" if fmt == "yaml" else
           "rule late match \"late.weight\":\n    geometry spectral(indicator)\n    lr=-1.0\n\n")
    text = (bench.yaml_spec if fmt == "yaml" else bench.dsl_spec)(200_000, tail=bad)
    assert 190_000 < len(text) <= 200_000
    line = text[:text.index("lr" + (": -1.0" if fmt == "yaml" else "=-1.0"))].count("\n") + 1
    assert line > text.count("\n") - 8  # near the end
    with pytest.raises(SpecError) as err:
        parse_spec(text, fmt, file="big")
    (diag,) = err.value.diagnostics
    assert (diag.code, diag.file, diag.line, diag.col) == ("GO005", "big", line, 9 if fmt == "yaml" else 8), diag
    assert "greater than or equal to 0" in diag.message
    if fmt == "yaml":
        assert [d.format() for d in _reference(text, fmt, monkeypatch).diagnostics] == [diag.format()]


@pytest.mark.parametrize("fmt", ["yaml", "dsl"])
def test_large_spec_lints_with_positions(fmt, monkeypatch):
    bench = _bench()
    bad = ("  - name: late\n    match: \"late.weight\"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n"
           "    constraint: {kind: l0, k: 3}\n" if fmt == "yaml" else
           "rule late match \"late.weight\":\n    geometry spectral(indicator)\n    constraint l0(k=3)\n\n")
    text = (bench.yaml_spec if fmt == "yaml" else bench.dsl_spec)(200_000, tail=bad)
    spec = parse_spec(text, fmt, file="big")
    diags = lint_spec(spec)
    errors = [d for d in diags if d.severity == "error"]
    assert [d.code for d in errors] == ["GO105"], errors
    at = text.index("{kind: l0" if fmt == "yaml" else "l0(k=3)")
    line = text[:at].count("\n") + 1
    col = at - text.rfind("\n", 0, at) + (len("{kind: ") if fmt == "yaml" else 0)
    assert (errors[0].line, errors[0].col) == (line, col)
    assert "spectral supports: stiefel, spectral_ball" in errors[0].message
    assert len(spec.rules) > 500 and {d.code for d in diags} >= {"GO105", "GO106", "GO107", "GO108", "GO109"}
    if fmt == "yaml":
        assert lint_spec(_reference(text, fmt, monkeypatch)) == diags


# ---------------------------------------------------------------- the libyaml path equals the reference


def _both(text: str):
    """(what the fast path made of ``text`` or None where it stepped aside, what the pure-Python
    loader makes of it), each as (data, values, keys) or the diagnostics."""
    source = yaml_front.SourceMap(file="f")
    try:
        fast = (repr(yaml_front._load_fast(text, source)), source.values, source.keys)
    except yaml_front._Fallback:
        fast = None
    original = yaml_front._load_fast
    yaml_front._load_fast = lambda text, source: (_ for _ in ()).throw(yaml_front._Fallback())
    try:
        parsed = yaml_front.parse_yaml(text, "f")
        ref = (repr(parsed.data), parsed.source.values, parsed.source.keys)
    except SpecError as exc:
        ref = [d.format() for d in exc.diagnostics]
    finally:
        yaml_front._load_fast = original
    return fast, ref


CORPUS = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.yaml"))] + [
    "a: &x [1, {b: 2}]\nc: *x\nd: *x\n",  # aliases: new containers, positions of the anchor
    "x: &a {y: &b [1]}\nz: *b\nw: *a\n",
    "1: a\n1.5: b\nnull: c\ntrue: d\n'q': e\n",  # keys that are not strings keep their text
    "a: !!str 1\nb: !!int '2'\nc: !!float 1\nd: !!bool true\ne: ! 12\n",
    "a: 'b\n  c'\nd: \"e\\\n  f\\x41\\u00e9\"\ng: |\n  h\n  i\nj: >-\n  k\n  l\n",
    "a:\r\n  b: [1, 2]\r\n",
    "\ufeffgeomopt: 1\n",
    "k: " + "[" * 63 + "]" * 63 + "\n",
]
DIVERGENT = [  # where libyaml and PyYAML's scanner differ: the fast path steps aside
    "a: b\tc\n", "{a: }", "? a", "--- # c", "{a: b?}", "|-#\n", "a: 1\n\ufeffb: 2\n",
    "a: 1\na: 2\n", "a: &x [*x]\n", "<<: {a: 1}\n", "a: !!set {x}\n", "--- 1\n--- 2\n", "",
    "k: " + "[" * 64 + "]" * 64 + "\n",
]


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_fast_path_builds_what_the_reference_builds(text):
    fast, ref = _both(text)
    assert fast is not None, "expected the fast path to take this"
    assert fast == ref


@pytest.mark.parametrize("text", DIVERGENT, ids=range(len(DIVERGENT)))
def test_fast_path_steps_aside_where_the_parsers_differ(text):
    fast, _ = _both(text)
    assert fast is None


_PIECES = ["- ", ": ", "&a ", "*a", "!!str ", "! ", "{", "}", "[", "]", ",", "? ", "|", ">-", "'", '"', "\\",
           "\\x41", "\t", "\n", "\r\n", "\x85", "\u2028", "\ufeff", "#", " # c", "---", "...", "a", "1e-3", "0x1F",
           ".inf", "~", "null", "true", "yes", "10:30", "é", "  ", "    ", "\x07", "<<: ", "a:b", "?"]
_TEXTS = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.yaml"))]


@st.composite
def _mutated(draw):
    text = draw(st.sampled_from(_TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = min(len(text), i + draw(st.integers(0, 20)))
        text = text[:i] + draw(st.sampled_from(_PIECES + [""])) + text[j:]
    return text


def _dumped(seed: int) -> str:
    """A random document as PyYAML's dumper writes it (anchors for shared values, both styles)."""
    rng = random.Random(seed)
    chars = list("abz09 -_.:#?!&*|>'\",[]{}") + ["\n", "é", "\u2028", "1.5", "true", "null", "0x1"]
    shared: list = []

    def value(depth):
        r = rng.random()
        if depth > 3 or r < 0.4:
            return rng.choice(["".join(rng.choice(chars) for _ in range(rng.randint(1, 6))), rng.randint(-9, 99),
                               0.5, 1e-8, True, None])
        if shared and r < 0.5:
            return rng.choice(shared)
        out = ({"".join(rng.choice(chars) for _ in range(rng.randint(1, 4))): value(depth + 1) for _ in range(3)}
               if r < 0.75 else [value(depth + 1) for _ in range(3)])
        shared.append(out)
        return out

    return yaml.dump({"geomopt": 1, "x": value(0)}, default_flow_style=rng.choice([True, False, None]),
                     allow_unicode=rng.random() < 0.5, width=rng.choice([20, 80]), sort_keys=False)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(_mutated(), st.integers(0, 10**6).map(_dumped)))
def test_fast_path_agrees_with_the_reference_on_any_text(text):
    fast, ref = _both(text)
    if fast is not None:
        assert fast == ref


# ---------------------------------------------------------------- the operator support table


def test_support_table_is_what_the_operators_register():
    from geomopt.geometry.operators import BACKWARD_OPS, get_backward

    assert list(BACKWARD_OPS) == list(support.BACKWARD_PAIRS)  # same pairs, same order
    assert {fn.__name__ for fn in BACKWARD_OPS.values()} == set(support.BACKWARD_TABLE)
    for (g, c), op in support.BACKWARD_PAIRS.items():
        assert get_backward(g, c).__name__ == op and support.has_backward(g, c)
    assert not support.has_backward("spectral", "l0") and get_backward("spectral", "l0") is None
    assert support.supported_constraints("adam") == []


def test_a_backward_op_needs_a_row_in_the_support_table():
    from geomopt.geometry.operators import backward_op

    def unlisted(y, t, ref, constraint, *, gamma, geometry, batch_dims):
        return y, None

    with pytest.raises(TypeError, match="BACKWARD_TABLE"):
        backward_op(unlisted)
    with pytest.raises(TypeError, match="BACKWARD_TABLE"):
        backward_op("spectral", "l0")


def test_the_spectral_module_runs_the_support_tables_lists():
    from geomopt.geometry import spectral

    assert spectral.polar_express_coefficients is support.polar_express_coefficients
    assert spectral.newton_schulz_coefficients is support.newton_schulz_coefficients
    assert support.realized_reference({"kind": "svd"}) is None
    eps = support.realized_reference({"kind": "polar_express", "steps": 5})["eps"]
    assert abs(eps - 1.02e-3) < 1e-5  # the table in geomopt.geometry.spectral's docstring
