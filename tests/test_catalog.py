"""The catalogue of published optimizers (specs/catalog/): each spec against an independent
implementation (a package, or a transcription of the paper's update rule, tests/catalog_cases.py),
and each spec lints clean, round-trips through the DSL, and holds the state its algorithm needs.

Each comparison runs twice (catalog_cases.MODES): on the same standard-normal gradients (the
optimizers' arithmetic alone; bounds of 0 where the two are bit-identical, else the case says
why), and on each model's own next-token loss (the two training trajectories). Measured figures
are printed (``pytest -s``); benchmarks/catalog.py writes them to benchmarks/results/catalog.json,
from which scripts/readme_tables.py renders the README's catalogue table.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import geomopt
from catalog_cases import CASES, CATALOG, MODELS, MODES, SHIPPED, run
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.spec import dump_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
BY_KEY = {c.key: c for c in CASES}
IDS = [c.key for c in CASES]
_RESULTS: dict = {}


def result(case, mode: str, monkeypatch) -> dict:
    """The comparison's figures, computed once per (case, mode) in this session (the package
    patches a case needs go through ``monkeypatch``, undone after the test that ran it)."""
    if (case.key, mode) not in _RESULTS:
        _RESULTS[case.key, mode] = run(case, mode, monkeypatch.setattr)
    return _RESULTS[case.key, mode]


# ---------------------------------------------------------------- the files


def test_every_catalogue_spec_has_a_case_and_a_header():
    files = sorted(p.stem for p in CATALOG.glob("*.yaml"))
    assert files == sorted(IDS), "each catalogue spec needs a case in tests/catalog_cases.py, and vice versa"
    assert len(files) >= 14
    for case in CASES:
        text = case.path.read_text(encoding="utf-8")
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        assert text.startswith("# yaml-language-server: $schema=../../schema/geomopt-1.schema.json\n"), case.key
        assert "Reference:" in header and re.search(r"\bRules?\b", header), case.key
        arxiv = re.search(r"arxiv\.org/abs/(\d{4}\.\d{4,5})", case.url or "")
        if arxiv:  # the header cites the paper the table links to
            assert f"arXiv:{arxiv.group(1)}" in header, case.key
        assert geomopt.load_spec(case.path).name == case.key


def test_package_data_and_test_extra():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    if sys.version_info >= (3, 11):
        import tomllib

        data = tomllib.loads(text)
        assert data["tool"]["setuptools"]["package-data"]["geomopt.specs.catalog"] == ["*"]
        test = " ".join(data["project"]["optional-dependencies"]["test"])
    else:  # pragma: no cover
        assert '"geomopt.specs.catalog" = ["*"]' in text
        test = text
    assert "lion-pytorch" in test and "pytorch-optimizer" in test


@pytest.mark.parametrize("case", [c for c in CASES if c.same_as], ids=lambda c: c.key)
def test_copies_equal_the_shipped_specs(case):
    """A catalogue file that copies a shipped spec (with a catalogue header) has its rules exactly."""
    assert geomopt.load_spec(case.path) == geomopt.load_spec(SHIPPED / f"{case.same_as}.yaml")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_lints_clean_against_its_model(case):
    """No error or warning against the model it is tested on (notes, e.g. GO109 for the adam
    geometry, are allowed)."""
    diags = lint_spec(geomopt.load_spec(case.path), model_params(MODELS[case.model]())[0])
    assert [(d.code, d.message) for d in diags if d.severity in ("error", "warning")] == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_round_trips_yaml_dsl_yaml(case):
    spec = geomopt.load_spec(case.path)
    dsl = parse_spec(dump_spec(spec, "dsl"), "dsl")
    back = parse_spec(dump_spec(dsl, "yaml"))
    assert dsl == spec and back == spec


# ---------------------------------------------------------------- against the references


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_its_reference(case, mode, monkeypatch):
    """‖X_geomopt − X_ref‖_F / ‖X_ref − X_0‖_F after ``case.steps`` steps, per tensor, at most the
    case's bound (``bound`` on the same gradients, ``loss_bound`` on the loss; each case's ``why``
    and ``loss_why`` say why a bound is not 0). Every tensor moved, and each went to the rule the
    case expects (its role read from the model by geomopt, checked against the names here)."""
    r = result(case, mode, monkeypatch)
    bound, why = (case.bound, case.why) if mode == "same" else (case.loss_bound, case.loss_why)
    print(f"\n{case.key} ({mode}, {r['steps']} steps, {r['model']}): max rel {r['max_rel']:.3g} on {r['worst_tensor']}, "
          f"all tensors {r['global_rel']:.3g}; bound {bound:g}")
    assert not r["unmoved"], f"tensors the reference did not move: {r['unmoved']}"
    assert r["routing_ok"], "geomopt routed a tensor to another rule than the case expects"
    assert r["max_rel"] <= bound, f"{case.key} ({mode}): {r['max_rel']:.3g} > {bound:g} ({why})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_holds_the_state_its_algorithm_needs(case, monkeypatch):
    """The elements of the state tensors geomopt keeps equal the reference's (momentum buffers,
    Adam moments, NorMuon's per-row and AdaMuon's per-entry second moments; none for signSGD)."""
    r = result(case, "same", monkeypatch)
    assert r["state_geomopt"] == r["state_reference"], (r["state_geomopt"], r["state_reference"])


def test_committed_figures_cover_the_catalogue():
    """benchmarks/results/catalog.json (the README's table) has every case, as the cases now
    describe it, with figures within their bounds: rerun ``python benchmarks/catalog.py`` and
    ``python scripts/readme_tables.py`` after changing a case."""
    rec = json.loads((ROOT / "benchmarks" / "results" / "catalog.json").read_text(encoding="utf-8"))
    assert [c["key"] for c in rec["cases"]] == IDS
    for entry in rec["cases"]:
        case = BY_KEY[entry["key"]]
        assert (entry["steps"], entry["reference"], entry["url"]) == (case.steps, case.reference, case.url), case.key
        assert entry["modes"]["same"]["bound"] == case.bound and entry["modes"]["loss"]["bound"] == case.loss_bound
        for mode in MODES:
            assert entry["modes"][mode]["max_rel"] <= entry["modes"][mode]["bound"], (case.key, mode)
        assert entry["state_geomopt"] == entry["state_reference"], case.key


@pytest.mark.parametrize("key", ["spectral-clip", "hyperball"])
def test_constrained_references_act_on_every_step(key, monkeypatch):
    """The brute-force references' set steps are active on every hidden matrix and step (6 per
    step: the q, k, v blocks of c_attn, c_proj, c_fc, the MLP's c_proj), so the comparison covers
    the constraint and not only uScion's step."""
    case = BY_KEY[key]
    for mode in MODES:
        assert result(case, mode, monkeypatch)["active"] == 6 * case.steps
