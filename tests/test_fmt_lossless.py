"""`geomopt fmt` is lossless for files: comments (own-line and trailing, the header, the
``$schema`` modeline) stay on their elements through ``fmt``, ``fmt --to dsl`` and back, and every
shipped spec is in canonical form.

The shipped specs are checked through the command (``main([...])``); a handmade spec puts comments
everywhere a user might (header, defaults, roles, rules, inside calls, on elements the printers
leave out, ``#`` inside strings); hypothesis puts random comments on random elements of random
specs and checks that both spellings give them back where they were.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomopt
from geomopt.cli.main import main
from geomopt.spec import printers
from geomopt.spec.comments import Comments, collect, scan_dsl, scan_yaml
from geomopt.spec.validate import parse_spec, source_of
from test_spec_roundtrip import specs

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
SHIPPED = sorted([*SPECS.glob("*.yaml"), *SPECS.glob("*.geom"), *(SPECS / "examples").glob("*.yaml")])
IDS = [str(p.relative_to(SPECS)) for p in SHIPPED]
OTHER = {".yaml": ".geom", ".geom": ".yaml"}
FORMAT = {".yaml": "yaml", ".geom": "dsl"}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def fmt(text: str, source: str, target: str | None = None) -> str:
    """What `geomopt fmt` prints for ``text`` (in the ``source`` spelling), in ``target``."""
    spec = parse_spec(text, source)
    return geomopt.dump_spec(spec, target or source, collect(text, source_of(spec)))


def comment_texts(text: str, format: str) -> list[str]:
    return [c.text for c in (scan_yaml(text) if format == "yaml" else scan_dsl(text))]


def test_there_are_shipped_specs_of_both_spellings():
    assert len([p for p in SHIPPED if p.suffix == ".yaml"]) >= 15
    assert len([p for p in SHIPPED if p.suffix == ".geom"]) >= 3


# ---------------------------------------------------------------- shipped specs


@pytest.mark.parametrize("path", SHIPPED, ids=IDS)
def test_shipped_spec_is_canonical(path, capsys):
    assert run(capsys, "fmt", path, "--check") == (0, "", "")
    code, out, _ = run(capsys, "fmt", path)
    assert code == 0 and out == path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", SHIPPED, ids=IDS)
def test_shipped_spec_through_the_other_spelling_and_back(path, capsys, tmp_path):
    """YAML → DSL → YAML (and DSL → YAML → DSL) gives the file back byte for byte, comments and
    modeline included; the converted file is itself canonical and means the same."""
    original = path.read_text(encoding="utf-8")
    other = tmp_path / ("converted" + OTHER[path.suffix])
    assert run(capsys, "fmt", path, "--to", FORMAT[other.suffix], "-o", other)[0] == 0
    assert run(capsys, "fmt", other, "--check") == (0, "", "")
    back = tmp_path / ("back" + path.suffix)
    assert run(capsys, "fmt", other, "--to", FORMAT[path.suffix], "-o", back)[0] == 0
    assert back.read_text(encoding="utf-8") == original
    assert geomopt.load_spec(other).model_dump() == geomopt.load_spec(path).model_dump()
    converted = other.read_text(encoding="utf-8")
    assert comment_texts(converted, FORMAT[other.suffix]) == comment_texts(original, FORMAT[path.suffix])


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.suffix == ".yaml"], ids=lambda p: p.stem)
def test_shipped_yaml_modeline_is_first_in_both_spellings(path):
    text = path.read_text(encoding="utf-8")
    first = text.splitlines()[0]
    assert re.fullmatch(r"# yaml-language-server: \$schema=(\.\./)+schema/geomopt-1\.schema\.json", first)
    # relative to the spec's folder in the repository: it names the committed schema/
    assert (path.parent / first.split("=", 1)[1]).resolve() == ROOT / "schema" / "geomopt-1.schema.json"
    assert fmt(text, "yaml", "dsl").splitlines()[0] == first


def test_muon_keeps_its_newton_schulz_dtype_note():
    text = (SPECS / "muon.yaml").read_text(encoding="utf-8")
    line = next(l for l in text.splitlines() if "approx:" in l)
    assert line.strip() == "approx: {kind: newton_schulz}  # 5 steps; dtype auto: bf16 on CUDA as torch.optim.Muon, fp32 on CPU"
    assert geomopt.load_spec(SPECS / "muon.yaml").rules[0].geometry.approx.dtype == "auto"
    dsl = fmt(text, "yaml", "dsl")
    assert "        approx=newton_schulz,  # 5 steps; dtype auto: bf16 on CUDA as torch.optim.Muon, fp32 on CPU\n" in dsl


# ---------------------------------------------------------------- a handmade spec

HAND = '''\
#yaml-language-server:  $schema=../schema/geomopt-1.schema.json
# Header one: "quoted # is text here"
# Header two

geomopt: 1   # version line
name: "hand # made"  # the name's
description: 'a #1 spec, it''s # not a comment'
# about the defaults
defaults:   # defaults trailing
  # before lr
  lr: 0.02  # lr trailing
  direction:
    kind: polyak   # on a kind line
    alpha: 0.1     # alpha trailing
roles:
  head: ["**.proj_out.weight", "re:.*#.*"]  # head patterns
# before the rules key
rules:   # on the rules line
  # before the first rule
  - name: hidden   # rule trailing
    # before match
    match:
      role: [hidden, expert]  # role trailing
      ndim: 2
    geometry:
      kind: spectral
      # before reference
      reference: {kind: power_barrier, kappa: 4.0, eps: 1.05e-3}
      approx: {kind: newton_schulz, steps: 5}   # steps is the default
    lr: 0.01  # rule lr
  - name: rest
    match: "**"  # everything else
    geometry: {kind: adam, betas: [0.9,   # first beta
                                   0.95]}
    # last own-line in the last rule
# footer one
# footer two
'''
HAND_COMMENTS = [
    "# Header one: \"quoted # is text here\"", "# Header two", "# version line", "# the name's",
    "# about the defaults", "# defaults trailing", "# before lr", "# lr trailing", "# on a kind line",
    "# alpha trailing", "# head patterns", "# before the rules key", "# on the rules line", "# before the first rule",
    "# rule trailing", "# before match", "# role trailing", "# before reference", "# steps is the default",
    "# rule lr", "# everything else", "# first beta", "# last own-line in the last rule", "# footer one", "# footer two",
]
MODELINE = "# yaml-language-server: $schema=../schema/geomopt-1.schema.json"

# (YAML line, DSL line) where each comment lands in canonical form: on or just above its element
HAND_PLACES = [
    ("geomopt: 1  # version line", "geomopt 1  # version line"),
    ('name: "hand # made"  # the name\'s', 'name "hand # made"  # the name\'s'),
    ("defaults:  # defaults trailing", "defaults  # defaults trailing"),
    ("  lr: 0.02  # lr trailing", "    lr=0.02  # lr trailing"),
    ("  direction:  # on a kind line", "    direction=polyak(  # on a kind line"),
    ("    alpha: 0.1  # alpha trailing", "        alpha=0.1,  # alpha trailing"),
    ('  head: ["**.proj_out.weight", "re:.*#.*"]  # head patterns', '    head=["**.proj_out.weight", "re:.*#.*"]  # head patterns'),
    ("  - name: hidden  # rule trailing", "rule hidden  # rule trailing"),
    ("      role: [hidden, expert]  # role trailing", "        role=[hidden, expert]  # role trailing"),
    ("      approx: {kind: newton_schulz}  # steps is the default", "        approx=newton_schulz,  # steps is the default"),
    ("    lr: 0.01  # rule lr", "    lr=0.01  # rule lr"),
    ('    match: "**"  # everything else', '    match "**":  # everything else'),
    ("    geometry: {kind: adam, betas: [0.9, 0.95]}  # first beta", "    geometry adam(betas=[0.9, 0.95])  # first beta"),
]
# own-line comments: (comment, the line of the element right after it) in YAML and in the DSL
HAND_ABOVE = [
    ("# about the defaults", "defaults:", "defaults"),
    ("# before lr", "  lr: 0.02", "    lr=0.02"),
    ("# before the first rule", "  - name: hidden", "rule hidden"),
    ("# before match", "    match:", "    match"),
    ("# before reference", "      reference:", "        power_barrier("),
]


def _line_after(text: str, comment: str) -> str:
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if l.strip() == comment)
    return lines[i + 1]


def test_handmade_comments_survive_both_conversions():
    yaml1 = fmt(HAND, "yaml")
    dsl = fmt(yaml1, "yaml", "dsl")
    yaml2 = fmt(dsl, "dsl", "yaml")
    assert yaml2 == yaml1
    assert fmt(dsl, "dsl") == dsl and fmt(yaml1, "yaml") == yaml1  # fixed points
    for text, format in ((yaml1, "yaml"), (dsl, "dsl")):
        found = comment_texts(text, format)
        assert found[0] == MODELINE
        assert sorted(found[1:]) == sorted(HAND_COMMENTS)
        # a `#` inside a string is text: it stays in the value and is no comment
        spec = parse_spec(text, format)
        assert spec.name == "hand # made" and spec.description == "a #1 spec, it's # not a comment"
        assert spec.roles["head"] == ["**.proj_out.weight", "re:.*#.*"]
        assert spec.model_dump() == parse_spec(HAND, "yaml").model_dump()


def test_handmade_comments_stay_on_their_elements():
    yaml_text = fmt(HAND, "yaml")
    dsl = fmt(HAND, "yaml", "dsl")
    assert fmt(dsl, "dsl", "yaml") == yaml_text
    y_lines, d_lines = yaml_text.splitlines(), dsl.splitlines()
    for y, d in HAND_PLACES:
        assert y in y_lines, y
        assert d in d_lines, d
    for comment, y_next, d_next in HAND_ABOVE:
        assert _line_after(yaml_text, comment).startswith(y_next), comment
        assert _line_after(dsl, comment).startswith(d_next), comment
    # the header stays the header, the modeline first; the footer stays last
    for text, first in ((yaml_text, "geomopt: 1"), (dsl, "geomopt 1")):
        lines = text.splitlines()
        assert lines[:3] == [MODELINE, '# Header one: "quoted # is text here"', "# Header two"]
        assert lines[3].startswith(first)
        assert lines[-3:] == ["# last own-line in the last rule", "# footer one", "# footer two"]
    # what stood before `rules:` (which the DSL has no line for) goes with the first rule, in order
    assert _line_after(yaml_text, "# before the rules key").strip() == "# on the rules line"
    assert _line_after(yaml_text, "# on the rules line").strip() == "# before the first rule"


def test_handmade_dsl_comments_inside_calls(capsys, tmp_path):
    dsl = '''\
# yaml-language-server: $schema=../schema/geomopt-1.schema.json
geomopt 1
name "calls"   # the name
defaults lr=0.02 direction=polyak(alpha=0.1)   # all defaults
rule hidden match role=[hidden, expert] ndim=2:   # the rule
    geometry spectral(   # a spectral step
        indicator,   # the lmo
        # how it is computed
        approx = newton_schulz(steps=6) ,
    )  # closing
    # a decoupled decay
    weight_decay=0.1
rule rest match "**":
    geometry euclidean  # the rest
'''
    path = tmp_path / "calls.geom"
    path.write_text(dsl, encoding="utf-8")
    code, canonical, _ = run(capsys, "fmt", path)
    assert code == 0
    assert "    geometry spectral(  # a spectral step\n        indicator,  # the lmo\n        # how it is computed\n" \
           "        approx=newton_schulz(steps=6),  # closing\n    )\n" in canonical
    assert 'defaults lr=0.02 direction=polyak(alpha=0.1)  # all defaults\n' in canonical
    assert "\n# yaml-language-server: $schema=" not in canonical and canonical.startswith("# yaml-language-server: $schema=")
    path.write_text(canonical, encoding="utf-8")
    assert run(capsys, "fmt", path, "--check") == (0, "", "")
    yml = tmp_path / "calls.yaml"
    assert run(capsys, "fmt", path, "--to", "yaml", "-o", yml)[0] == 0
    yaml_text = yml.read_text(encoding="utf-8")
    assert "      reference: {kind: indicator}  # the lmo\n      # how it is computed\n" \
           "      approx: {kind: newton_schulz, steps: 6}  # closing\n" in yaml_text
    assert "    # a decoupled decay\n    weight_decay: 0.1\n" in yaml_text
    assert run(capsys, "fmt", yml, "--to", "dsl")[1] == canonical
    assert geomopt.load_spec(yml) == geomopt.parse_spec(dsl, "dsl")


def test_comments_on_elements_not_printed_move_to_their_parent():
    """A default value, a `kind:` line, a rule's `name:`: the printers leave no line for these,
    so their comments go to the element that holds them, none lost."""
    text = '''\
geomopt: 1
name: x
defaults: {}   # nothing set
rules:
  - match: "**"
    # named after what it matches
    name: all
    geometry:
      kind: spectral   # the spectral step
      reference:
        kind: log_barrier  # ε written out
        eps: 1.0e-8
      approx:
        kind: newton_schulz   # Muon's
        steps: 5   # the default
'''
    out = fmt(text, "yaml")
    assert out == '''\
geomopt: 1
name: x
rules:
  # nothing set
  # named after what it matches
  - name: all
    match: "**"
    geometry:  # the spectral step
      kind: spectral
      reference: {kind: log_barrier, eps: 1.0e-8}  # ε written out
      # the default
      approx: {kind: newton_schulz}  # Muon's
'''
    assert fmt(fmt(out, "yaml", "dsl"), "dsl", "yaml") == out


def test_modeline_goes_first_only_from_the_header():
    text = ('# about this spec\n#  yaml-language-server:$schema=https://example.org/s.json\ngeomopt: 1\nname: m\n'
            'rules:\n  # yaml-language-server: $schema=not-a-modeline-here\n  - name: a\n    match: "**"\n'
            '    geometry: {kind: euclidean}\n')
    for format in ("yaml", "dsl"):
        out = fmt(text, "yaml", format)
        lines = out.splitlines()
        assert lines[:2] == ["# yaml-language-server: $schema=https://example.org/s.json", "# about this spec"]
        assert "# yaml-language-server: $schema=not-a-modeline-here" in [l.strip() for l in lines[3:]]
        assert fmt(out, format, "yaml") == fmt(text, "yaml")


def test_fmt_check_sees_comment_layout(capsys, tmp_path):
    """Comments are part of the canonical form: three spaces before a `#`, a lost indent fail the check."""
    canonical = (SPECS / "muon.yaml").read_text(encoding="utf-8")
    path = tmp_path / "m.yaml"
    for bad in (canonical.replace("}  # 5 steps", "}   # 5 steps"), canonical.replace("\n# torch", "\n\n# torch", 1)):
        assert bad != canonical
        path.write_text(bad, encoding="utf-8")
        code, _, err = run(capsys, "fmt", path, "--check")
        assert code == 1 and "would reformat" in err
        assert run(capsys, "fmt", path, "-o", path)[0] == 0
        assert path.read_text(encoding="utf-8") == canonical


def test_dump_spec_without_comments_prints_none():
    spec = parse_spec(HAND, "yaml")
    for format in ("yaml", "dsl"):
        text = geomopt.dump_spec(spec, format)
        assert text == geomopt.dump_spec(spec, format, Comments())
        assert comment_texts(text, format) == []
        assert parse_spec(text, format) == spec


# ---------------------------------------------------------------- finding comments


def test_scan_yaml_skips_hashes_in_strings():
    text = ('a: "x # y"  # one\nb: \'p # q\'\nc: x#y\nd: |  # two\n  text # three is text\n'
            'e: [1,   # four\n    2]\n# five\n')
    assert [(c.line, c.text, c.own_line) for c in scan_yaml(text)] == [
        (1, "# one", False), (4, "# two", False), (6, "# four", False), (8, "# five", True)]


def test_scan_dsl_skips_hashes_in_strings():
    text = 'name "a\\"#b"  # one\n# two\nrule x match "#":\n    lr=1 # three\n'
    assert [(c.line, c.col, c.text, c.own_line) for c in scan_dsl(text)] == [
        (1, 15, "# one", False), (2, 1, "# two", True), (4, 10, "# three", False)]


# ---------------------------------------------------------------- random comments on random specs

comment = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12).map(
    lambda t: ("# " + t).rstrip())


@st.composite
def commented_specs(draw):
    spec = draw(specs())
    where = printers.elements(printers._data(spec))
    before = draw(st.dictionaries(st.sampled_from(where), st.lists(comment, min_size=1, max_size=2), max_size=5))
    trailing = draw(st.dictionaries(st.sampled_from(where), comment, max_size=5))
    head = draw(st.lists(comment, max_size=2))
    foot = draw(st.lists(comment, max_size=2))
    return spec, Comments(header=head, before=before, trailing=trailing, footer=foot)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commented_specs())
def test_random_comments_come_back_on_their_elements(case):
    spec, comments = case
    expected = comments.resolve(printers.elements(printers._data(spec)))
    texts = {}
    for format in ("yaml", "dsl"):
        text = geomopt.dump_spec(spec, format, comments)
        parsed = parse_spec(text, format)
        assert parsed == spec, text
        found = collect(text, source_of(parsed))
        assert (found.header, found.before, found.trailing, found.footer) == \
            (expected.header, expected.before, expected.trailing, expected.footer), text
        assert geomopt.dump_spec(parsed, format, found) == text  # a fixed point
        texts[format] = text
    assert fmt(texts["yaml"], "yaml", "dsl") == texts["dsl"]
    assert fmt(texts["dsl"], "dsl", "yaml") == texts["yaml"]
