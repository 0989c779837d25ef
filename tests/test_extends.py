"""Spec inheritance (``extends``) and presets (shipped specs by name): merge semantics, positions
of diagnostics across files, every inheritance error with its code and line:col in both
spellings, ``geomopt fmt`` (as written and ``--resolved``), the JSON Schema, and presets through
GeomOptimizer, compile_spec and the CLI."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.models import MODELS
from geomopt.spec.diagnostics import LANGUAGE_CODES
from geomopt.spec.extends import At, shipped_specs
from geomopt.spec.schema import schema_text
from geomopt.spec.validate import source_of
from geomopt.spec.yaml_front import parse_yaml

SPECS = Path(__file__).resolve().parents[1] / "specs"
MUON_RULES = ["hidden", "embeddings", "head", "rest"]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def pos_of(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the ``nth`` occurrence of ``needle`` in ``text``."""
    at = -1
    for _ in range(nth + 1):
        at = text.index(needle, at + 1)
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def first_error(path: Path) -> geomopt.Diagnostic:
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.load_spec(path)
    d = info.value.diagnostics[0]
    assert d.severity == "error" and d.name == LANGUAGE_CODES[d.code][0]
    assert "Traceback" not in str(info.value)
    return d


def names(spec) -> list[str]:
    return [r.name for r in spec.rules]


BASE = """geomopt: 1
name: base
description: the base
defaults:
  lr: 0.02
  weight_decay: 0.1
  direction: {kind: polyak, alpha: 0.1, nesterov: true}
roles:
  head: ["lm_head.weight"]
  norm: ["**.ln.weight"]
rules:
  - name: a
    match: "a.*"
    geometry: {kind: spectral, reference: {kind: indicator}, approx: {kind: newton_schulz, steps: 5}, scale: scion}
    constraint: {kind: frobenius_ball, radius: 0.5}
    lr: 0.01
  - name: b
    match: {name: "b.*", ndim: 2}
    geometry: {kind: adam, betas: [0.9, 0.95]}
  - name: c
    match: "**"
    geometry: {kind: euclidean}
"""


# ---------------------------------------------------------------- merge semantics


def test_override_merges_field_by_field_in_place(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", """geomopt: 1
extends: base.yaml
name: child
defaults:
  lr: 0.05
  direction: {kind: polyak, nesterov: false}
roles:
  head: ["out.weight"]
rules:
  - name: a
    geometry: {kind: spectral, approx: {kind: newton_schulz, steps: 3}}
    weight_decay: 0.0
  - name: b
    match: "bb.*"
    geometry: {kind: euclidean}
""")
    spec = geomopt.load_spec(child)
    assert spec.extends == "base.yaml" and spec.name == "child"
    assert spec.description is None  # name and description are the file's own
    assert names(spec) == ["a", "b", "c"]  # overrides keep their base rule's place
    d = spec.defaults
    assert (d.lr, d.weight_decay) == (0.05, 0.1)
    assert (d.direction.kind, d.direction.alpha, d.direction.nesterov) == ("polyak", 0.1, False)  # same kind: merged
    assert spec.roles == {"head": ["out.weight"], "norm": ["**.ln.weight"]}  # per role, the list whole
    a, b, _ = spec.rules
    assert a.geometry.approx.steps == 3 and a.geometry.scale == "scion" and a.geometry.reference.kind == "indicator"
    assert a.constraint.radius == 0.5 and a.lr == 0.01 and a.weight_decay == 0.0
    assert a.match.name == "a.*"
    assert b.geometry.kind == "euclidean" and not hasattr(b.geometry, "betas")  # another kind: replaced whole
    assert b.match.name == "bb.*" and b.match.ndim is None  # match: replaced whole


def test_new_rules_before_after_and_appended_keep_the_childs_order(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", """geomopt: 1
extends: base.yaml
name: child
rules:
  - {name: x1, after: a, match: "x1", geometry: {kind: euclidean}}
  - {name: end, match: "end", geometry: {kind: euclidean}}
  - {name: x2, after: a, match: "x2", geometry: {kind: euclidean}}
  - {name: y1, before: c, match: "y1", geometry: {kind: euclidean}}
  - {name: y2, before: c, match: "y2", geometry: {kind: euclidean}}
  - {name: z, before: a, match: "z", geometry: {kind: euclidean}}
""")
    spec = geomopt.load_spec(child)
    assert names(spec) == ["z", "a", "x1", "x2", "b", "y1", "y2", "c", "end"]


def test_remove_drops_a_base_rule_and_may_anchor_new_ones(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", """geomopt: 1
extends: base.yaml
name: child
rules:
  - {name: b, remove: true}
  - {name: n, after: b, match: "n", geometry: {kind: euclidean}}
  - {name: c, remove: false, lr: 0.5}
""")
    spec = geomopt.load_spec(child)
    assert names(spec) == ["a", "n", "c"] and spec.rules[2].lr == 0.5


def test_yaml_null_resets_an_optional_field(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "geomopt: 1\nextends: base.yaml\nname: child\nrules:\n  - {name: a, constraint: null, lr: null}\n")
    a = geomopt.load_spec(child).rules[0]
    assert a.constraint is None and a.lr is None


def test_multi_level_with_paths_relative_to_each_file(tmp_path):
    write(tmp_path, "lib/base.yaml", BASE)
    write(tmp_path, "lib/mid.geom", """geomopt 1
extends "base.yaml"
name "mid"
defaults lr=0.03

rule a:
    lr=0.001

rule m match "m.*":
    before=c
    geometry euclidean
""")
    top = write(tmp_path, "top.yaml", """geomopt: 1
extends: lib/mid.geom
name: top
rules:
  - name: m
    lr: 0.2
  - {name: b, remove: true}
""")
    spec = geomopt.load_spec(top)
    assert names(spec) == ["a", "m", "c"]
    assert spec.defaults.lr == 0.03 and spec.defaults.weight_decay == 0.1
    assert spec.rules[0].lr == 0.001 and spec.rules[1].lr == 0.2 and spec.rules[0].geometry.approx.steps == 5
    # each value remembers the file it came from
    src = source_of(spec)
    assert src.locate(("rules", 1, "lr")).file == str(top)
    assert src.locate(("rules", 1, "geometry")).file == str(tmp_path / "lib" / "mid.geom")
    assert src.locate(("rules", 0, "constraint")).file == str(tmp_path / "lib" / "base.yaml")
    # a spec that extends a shipped spec which is itself extended
    write(tmp_path, "m2.yaml", "geomopt: 1\nextends: muon\nname: m2\n")
    m3 = write(tmp_path, "m3.yaml", "geomopt: 1\nextends: ./m2.yaml\nname: m3\n")
    assert names(geomopt.load_spec(m3)) == MUON_RULES


def test_extends_muon_with_one_override_equals_the_hand_written_spec(tmp_path):
    child = write(tmp_path, "child.yaml", "geomopt: 1\nextends: muon\nname: muon-slow\nrules:\n  - name: hidden\n    lr: 0.01\n")
    muon = (SPECS / "muon.yaml").read_text(encoding="utf-8")
    nesterov = "    direction: {kind: polyak, alpha: 0.05, nesterov: true}\n"
    assert "name: muon\n" in muon and nesterov in muon
    by_hand = geomopt.parse_spec(muon.replace("name: muon\n", "name: muon-slow\n").replace(nesterov, nesterov + "    lr: 0.01\n"))
    spec = geomopt.load_spec(child)
    assert spec.model_dump() == by_hand.model_dump()
    assert spec == by_hand and spec.extends == "muon" and by_hand.extends is None
    assert "extends" not in spec.model_dump()
    # the same from the DSL, from a dict, and from spec text
    geom = write(tmp_path, "child.geom", 'geomopt 1\nextends "muon"\nname "muon-slow"\n\nrule hidden:\n    lr=0.01\n')
    assert geomopt.load_spec(geom) == by_hand
    data = {"geomopt": 1, "extends": "muon", "name": "muon-slow", "rules": [{"name": "hidden", "lr": 0.01}]}
    assert geomopt.compile.as_spec(data) == by_hand and data["rules"] == [{"name": "hidden", "lr": 0.01}]
    assert geomopt.compile.as_spec(child.read_text(encoding="utf-8")) == by_hand
    assert pickle.loads(pickle.dumps(spec)) == spec


# ---------------------------------------------------------------- positions of diagnostics


def test_validation_errors_point_at_the_file_that_wrote_the_value(tmp_path):
    bad_base = BASE.replace("radius: 0.5", "radius: -1")
    base = write(tmp_path, "base.yaml", bad_base)
    text = "geomopt: 1\nextends: base.yaml\nname: child\nrules:\n  - name: b\n    geometry: {kind: adam, betas: [0.9, 0.95], eps: 0}\n"
    child = write(tmp_path, "child.yaml", text)
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.load_spec(child)
    found = {(d.file, d.line, d.col, d.code) for d in info.value.diagnostics}
    assert found == {(str(child), *pos_of(text, "0}"), "GO005"), (str(base), *pos_of(bad_base, "-1"), "GO005")}
    assert info.value.diagnostics[0].file == str(child)  # the child's own first
    # a missing field of a new rule, an unknown field in an override: at the child's keys
    text = "geomopt: 1\nextends: base.yaml\nname: child\nrules:\n  - {name: a, lrr: 1}\n  - {name: new, match: x}\n"
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", text)
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.load_spec(child)
    found = [(d.code, d.file, d.line, d.col) for d in info.value.diagnostics]
    assert found == [("GO003", str(child), *pos_of(text, "lrr")), ("GO006", str(child), *pos_of(text, "{name: new"))]
    # geomopt and name are required in the child itself
    child = write(tmp_path, "child.yaml", "geomopt: 1\nextends: base.yaml\n")
    d = first_error(child)
    assert (d.code, d.file, d.line, d.col) == ("GO006", str(child), 1, 1) and "'name'" in d.message


def test_lint_of_inherited_rules_stays_in_the_childs_file(tmp_path):
    text = "geomopt: 1\nname: child\nextends: muon\nrules:\n  - {name: extra, after: head, match: nothing, geometry: {kind: euclidean}}\n"
    child = write(tmp_path, "child.yaml", text)
    spec = geomopt.load_spec(child)
    found = lint_spec(spec, model_params(MODELS["gpt"]())[0])
    assert found and all(d.file == str(child) for d in found)
    unused = next(d for d in found if d.code == "GO102")
    assert (unused.line, unused.col) == pos_of(text, "nothing")
    inherited = next(d for d in found if d.code == "GO109" and "'embeddings'" in d.message)
    assert (inherited.line, inherited.col) == (3, 1)  # at `extends`


# ---------------------------------------------------------------- errors, YAML and DSL


ERRORS = [
    # (name, YAML text, DSL text, code, what the message says, the key the error points at)
    ("unknown shipped name",
     "geomopt: 1\nname: x\nextends: muonn\n",
     'geomopt 1\nname "x"\nextends "muonn"\n',
     "GO011", ["did you mean 'muon'?", "shipped specs: ", "scion"], "extends"),
    ("unknown path",
     "geomopt: 1\nextends: ./nowhere.yaml\nname: x\n",
     'geomopt 1\nextends "./nowhere.yaml"\nname "x"\n',
     "GO011", ["no spec file './nowhere.yaml'", "muon"], "extends"),
    ("path that is no spec file",
     "geomopt: 1\nextends: base.txt\nname: x\n",
     'geomopt 1\nextends "base.txt"\nname "x"\n',
     "GO011", ["not a spec file"], "extends"),
    ("extends a number",
     "geomopt: 1\nextends: 3\nname: x\n",
     'geomopt 1\nextends 3\nname "x"\n',
     "GO014", ["not a number", "as a string"], "extends"),
    ("extends a list",
     "geomopt: 1\nextends: [muon]\nname: x\n",
     'geomopt 1\nextends ["muon"]\nname "x"\n',
     "GO014", ["not a list"], "extends"),
    ("before a rule the base lacks",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - name: extra\n    before: hed\n    match: \"**\"\n    geometry: {kind: euclidean}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule extra match "**":\n    before=hed\n    geometry euclidean\n',
     "GO013", ["rules[0].before", "no rule 'hed'", "did you mean 'head'?", "its rules: hidden, embeddings, head, rest"], "before"),
    ("after a rule the base lacks",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: extra, match: \"**\", geometry: {kind: euclidean}, after: nope}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule extra match "**":\n    geometry euclidean\n    after=nope\n',
     "GO013", ["no rule 'nope'", "its rules: hidden, embeddings, head, rest"], "after"),
    ("both before and after",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - name: extra\n    before: head\n    after: head\n    match: \"**\"\n    geometry: {kind: euclidean}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule extra match "**":\n    before=head\n    after=head\n    geometry euclidean\n',
     "GO013", ["not both"], "after"),
    ("an override placed",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: hidden, lr: 0.1, after: rest}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule hidden:\n    lr=0.1\n    after=rest\n',
     "GO013", ["keeps its place"], "after"),
    ("remove a rule the base lacks",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: hiden, remove: true}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule hiden:\n    remove=true\n',
     "GO013", ["no rule 'hiden' to remove", "did you mean 'hidden'?"], "remove"),
    ("remove with other fields",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: hidden, lr: 0.1, remove: true}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule hidden:\n    lr=0.1\n    remove=true\n',
     "GO013", ["drop its other fields (lr)"], "remove"),
    ("placement without extends",
     "geomopt: 1\nname: x\nrules:\n  - {name: a, match: \"**\", geometry: {kind: euclidean}, after: b}\n",
     'geomopt 1\nname "x"\n\nrule a match "**":\n    geometry euclidean\n    after=b\n',
     "GO013", ["only in a spec with 'extends"], "after"),
    ("before given a number",
     "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: a, match: \"**\", geometry: {kind: euclidean}, before: 1}\n",
     'geomopt 1\nextends "muon"\nname "x"\n\nrule a match "**":\n    geometry euclidean\n    before=1\n',
     "GO013", ["a string"], "before"),
]


@pytest.mark.parametrize("fmt", ["yaml", "dsl"])
@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_inheritance_errors(tmp_path, case, fmt):
    _, yaml_text, dsl_text, code, hints, key = case
    text = yaml_text if fmt == "yaml" else dsl_text
    path = write(tmp_path, "spec." + ("yaml" if fmt == "yaml" else "geom"), text)
    d = first_error(path)
    keyword = key + (":" if fmt == "yaml" else ("=" if key in ("before", "after", "remove") else " "))
    assert (d.code, d.file, d.line, d.col) == (code, str(path), *pos_of(text, keyword)), d.format()
    for hint in hints:
        assert hint in d.message, (hint, d.message)
    # parse_spec reports the same (a relative path then reads from the working directory)
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec(text, fmt, file=str(path))
    assert info.value.diagnostics[0] == d


@pytest.mark.parametrize("suffix", [".yaml", ".geom"])
def test_inheritance_cycles_name_the_chain(tmp_path, suffix):
    if suffix == ".yaml":
        a_text, b_text = "geomopt: 1\nextends: b.yaml\nname: a\n", "geomopt: 1\nname: b\nextends: sub/../a.yaml\n"
    else:
        a_text, b_text = 'geomopt 1\nextends "b.geom"\nname "a"\n', 'geomopt 1\nname "b"\nextends "sub/../a.geom"\n'
    (tmp_path / "sub").mkdir()
    a = write(tmp_path, "a" + suffix, a_text)
    b = write(tmp_path, "b" + suffix, b_text)
    d = first_error(a)
    assert (d.code, d.file, d.line, d.col) == ("GO012", str(b), 3, 1), d.format()
    assert f"{a} → {b} → {tmp_path / 'sub' / '..' / ('a' + suffix)}" in d.message
    # a spec that extends itself
    own = write(tmp_path, "own" + suffix, a_text.replace("b" + suffix, "own" + suffix))
    d = first_error(own)
    assert (d.code, d.file, d.line, d.col) == ("GO012", str(own), 2, 1) and f"{own} → {own}" in d.message


def test_dsl_rule_without_match_needs_extends():
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec('geomopt 1\nname "x"\nrule hidden:\n    lr=0.1\n', "dsl")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO001", 3, 12) and "'extends'" in d.message


def test_base_syntax_errors_point_into_the_base(tmp_path):
    base = write(tmp_path, "base.geom", 'geomopt 1\nname "b"\nrule a match "**"\n    geometry euclidean\n')
    child = write(tmp_path, "child.yaml", "geomopt: 1\nextends: base.geom\nname: c\n")
    d = first_error(child)
    assert (d.code, d.file) == ("GO001", str(base))
    write(tmp_path, "base.yaml", "geomopt: 2\nname: b\n")
    d = first_error(write(tmp_path, "child.yaml", "geomopt: 1\nextends: base.yaml\nname: c\n"))
    assert (d.code, d.file, d.line, d.col) == ("GO008", str(tmp_path / "base.yaml"), 1, 10)


def test_codes_are_registered_and_explained(capsys):
    for code in ("GO011", "GO012", "GO013", "GO014"):
        assert main(["rule", code]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{code} {LANGUAGE_CODES[code][0]} (error)")
    assert main(["rule"]) == 0 and "inheritance-cycle" in capsys.readouterr().out


# ---------------------------------------------------------------- fmt: as written, and resolved


CHILD_YAML = """# yaml-language-server: $schema=../schema/geomopt-1.schema.json
# a slower Muon
geomopt: 1
extends: muon
name: muon-slow
defaults:
  lr: 0.01
  weight_decay: 0.0
rules:
  - name: hidden  # fewer iterations
    geometry: {kind: spectral, approx: {kind: newton_schulz, steps: 3}, view: auto}
  - name: gains
    match: {role: [norm, bias]}
    after: head
    geometry: {kind: euclidean}
    decay: {kind: cautious}
  - name: rest
    remove: true
"""


def test_fmt_keeps_extends_and_round_trips_both_spellings(tmp_path, capsys):
    src = write(tmp_path, "child.yaml", CHILD_YAML)
    spec = geomopt.load_spec(src)
    assert main(["fmt", str(src), "--check"]) == 0, capsys.readouterr()
    assert main(["fmt", str(src), "--to", "dsl", "-o", str(tmp_path / "child.geom")]) == 0
    dsl = (tmp_path / "child.geom").read_text(encoding="utf-8")
    assert 'extends "muon"' in dsl and "rule hidden:" in dsl and "after=head" in dsl and "remove=true" in dsl
    assert "# fewer iterations" in dsl and "# a slower Muon" in dsl
    assert geomopt.load_spec(tmp_path / "child.geom") == spec
    assert main(["fmt", str(tmp_path / "child.geom"), "--check"]) == 0, capsys.readouterr()
    assert main(["fmt", str(tmp_path / "child.geom"), "--to", "yaml"]) == 0
    back = capsys.readouterr().out
    assert back == CHILD_YAML
    assert geomopt.parse_spec(back, file=str(src)) == spec
    # shorthands are spelled out, values equal to a default kept (they override the base's)
    loose = write(tmp_path, "loose.yaml", "geomopt: 1\nname: x\nextends: muon\ndefaults: {lr: 0.02}\nrules:\n"
                  "  - {name: hidden, geometry: {view: auto, kind: spectral}, decay: cautious}\n")
    assert main(["fmt", str(loose)]) == 0
    assert capsys.readouterr().out == ("geomopt: 1\nextends: muon\nname: x\ndefaults:\n  lr: 0.02\nrules:\n  - name: hidden\n"
                                       "    geometry: {kind: spectral, view: auto}\n    decay: {kind: cautious}\n")


def test_fmt_resolved_prints_the_merged_spec(tmp_path, capsys):
    src = write(tmp_path, "child.yaml", CHILD_YAML)
    assert main(["fmt", str(src), "--resolved"]) == 0
    merged = capsys.readouterr().out
    assert "extends" not in merged and "remove" not in merged and "after" not in merged
    resolved = geomopt.parse_spec(merged)
    assert resolved == geomopt.load_spec(src) and resolved.extends is None
    assert names(resolved) == ["hidden", "embeddings", "head", "gains"]
    assert main(["fmt", str(src), "--resolved", "--to", "dsl"]) == 0
    assert geomopt.parse_spec(capsys.readouterr().out, "dsl") == resolved
    assert main(["fmt", str(src), "--resolved", "--check"]) == 2
    assert "--check" in capsys.readouterr().err


def test_a_null_has_no_dsl_spelling(tmp_path, capsys):
    src = write(tmp_path, "child.yaml", "geomopt: 1\nextends: muon\nname: x\nrules:\n  - {name: hidden, direction: null}\n")
    assert geomopt.load_spec(src).rules[0].direction is None
    assert main(["fmt", str(src), "--to", "dsl"]) == 2
    out, err = capsys.readouterr()
    assert "keep this spec in YAML" in err and "Traceback" not in err


def test_schema_accepts_an_extending_spec():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    data = parse_yaml(CHILD_YAML).data
    assert not [e.message for e in validator.iter_errors(data)]
    assert not list(validator.iter_errors({"geomopt": 1, "extends": "muon", "name": "x"}))
    bad = json.loads(json.dumps(data))
    bad["rules"][0]["lrr"] = 1
    assert list(validator.iter_errors(bad))
    del bad["extends"], bad["rules"][0]["lrr"]  # without extends: whole rules, and rules are required
    assert list(validator.iter_errors(bad))
    assert list(validator.iter_errors({"geomopt": 1, "name": "x"}))
    assert list(validator.iter_errors({**data, "extends": None, "rules": [{"name": "hidden", "lr": 0.1}]}))


# ---------------------------------------------------------------- presets


def test_shipped_specs():
    shipped = geomopt.shipped_specs()
    assert shipped == shipped_specs()
    assert {"muon", "scion", "uscion", "adamw-hybrid"} <= set(shipped)
    assert shipped["muon"] == SPECS / "muon.yaml"  # YAML where both spellings ship
    for path in shipped.values():
        assert path.is_file() and path.suffix in (".yaml", ".yml", ".geom")


def test_presets_through_geomoptimizer_and_compile_spec():
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    opt = geomopt.GeomOptimizer(model, "muon")
    assert opt.spec == geomopt.load_spec(SPECS / "muon.yaml")
    x = torch.randint(0, 256, (2, 16))
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    assert not torch.equal(before, model.transformer.h[0].attn.c_attn.weight)
    plan = compile_spec("scion", model)
    assert plan.spec_name == "scion"
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.GeomOptimizer(model, "muonn")
    d = info.value.diagnostics[0]
    assert d.code == "GO010" and "did you mean 'muon'?" in d.message and "scion" in d.message
    with pytest.raises(geomopt.SpecError) as info:
        compile_spec("nowhere/spec.yaml", model)
    assert "shipped specs: " in info.value.diagnostics[0].message


def test_presets_through_the_cli(capsys, tmp_path):
    assert main(["lint", "muon", "scion"]) == 0
    capsys.readouterr()
    assert main(["plan", "uscion", "--model", "gpt"]) == 0
    assert "hidden" in capsys.readouterr().out
    assert main(["explain", "muon", "transformer.h.0.attn.c_attn.weight", "--model", "gpt"]) == 0
    assert "hidden" in capsys.readouterr().out
    assert main(["fmt", "muon", "--check"]) == 0
    assert main(["fmt", "muon", "--to", "dsl"]) == 0
    assert geomopt.parse_spec(capsys.readouterr().out, "dsl") == geomopt.load_spec("muon")
    for argv in (["lint", "muonn"], ["plan", "muonn", "--model", "gpt"], ["fmt", "muonn"],
                 ["explain", "muonn", "x", "--model", "gpt"]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert "GO010" in out + err and "did you mean 'muon'?" in out + err and "Traceback" not in out + err
    # an extending spec through the CLI: lint, plan
    child = write(tmp_path, "child.yaml", CHILD_YAML)
    assert main(["lint", str(child), "--model", "gpt"]) == 0
    assert main(["plan", str(child), "--model", "gpt"]) == 0
    assert "gains" in capsys.readouterr().out
    bad = write(tmp_path, "bad.yaml", "geomopt: 1\nextends: muonn\nname: x\n")
    assert main(["lint", str(bad)]) == 1
    out, _ = capsys.readouterr()
    assert out.startswith(f"{bad}:2:1: error GO011 ")


# ---------------------------------------------------------------- hostile chains


def test_extends_a_file_name_too_long_is_a_positioned_error(tmp_path):
    """Path.is_file() raised OSError (File name too long): a traceback."""
    text = "geomopt: 1\nname: a\nextends: " + "b" * 300 + ".yaml\n"
    d = first_error(write(tmp_path, "a.yaml", text))
    assert (d.code, d.file, d.line, d.col) == ("GO011", str(tmp_path / "a.yaml"), 3, 1), d.format()
    assert d.message.startswith(f"extends: cannot read {'b' * 300 + '.yaml'!r}: File name too long")


def _chain(tmp_path: Path, n: int) -> Path:
    """s0.yaml extends s1.yaml … extends s{n}.yaml, which extends nothing: n bases."""
    for i in range(n):
        write(tmp_path, f"s{i}.yaml", f"geomopt: 1\nname: s{i}\nextends: s{i + 1}.yaml\n")
    write(tmp_path, f"s{n}.yaml", "geomopt: 1\nname: base\nrules:\n  - name: all\n    match: '**'\n"
                                  "    geometry: {kind: euclidean}\n")
    return tmp_path / "s0.yaml"


def test_a_chain_of_200_bases_resolves(tmp_path):
    spec = geomopt.load_spec(_chain(tmp_path, 200))
    assert spec.name == "s0" and [r.name for r in spec.rules] == ["all"]


def test_extends_chain_over_the_limit_is_a_positioned_error(tmp_path, capsys):
    """A 1,200-file chain raised RecursionError (a traceback)."""
    from geomopt.spec.extends import MAX_EXTENDS_DEPTH

    first = _chain(tmp_path, 1200)
    d = first_error(first)
    last = tmp_path / f"s{MAX_EXTENDS_DEPTH}.yaml"  # its extends would be one base too many
    assert (d.code, d.file, d.line, d.col) == ("GO012", str(last), 3, 1), d.format()
    assert d.message.startswith(f"more than {MAX_EXTENDS_DEPTH} bases in a chain of 'extends'")
    assert f"more than {MAX_EXTENDS_DEPTH} bases" in LANGUAGE_CODES["GO012"][1]  # `geomopt rule GO012` says the limit
    guide = " ".join((SPECS.parent / "docs" / "guide" / "specs.md").read_text(encoding="utf-8").split())
    assert f"a chain of more than {MAX_EXTENDS_DEPTH} bases" in guide
    assert main(["lint", str(first)]) == 1  # a spec error, as a cycle is
    out, err = capsys.readouterr()
    assert f"{last}:3:1: error GO012" in out and "Traceback" not in out + err
    # at the limit exactly, the chain resolves
    assert geomopt.load_spec(_chain(tmp_path / "exact", MAX_EXTENDS_DEPTH)).name == "s0"
