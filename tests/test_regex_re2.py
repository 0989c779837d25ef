"""``re:`` patterns mean what Python's ``re.fullmatch`` means on every name, or are refused with a
positioned GO007; globs' ``**`` crosses line breaks. Differential: patterns and names generated
from small grammars, each pattern run on RE2 (as :mod:`geomopt.spec.regex_re2` writes it) and on
the engine :func:`compile_pattern` picks, against Python's ``re``.

``GEOMOPT_REGEX_EXAMPLES`` sets how many examples the generated tests run (300 by default)."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from geomopt.spec.diagnostics import SpecError
from geomopt.spec.patterns import _glob_regex, _glob_tokens, _re2_matcher, compile_pattern, pattern_error
from geomopt.spec.validate import parse_spec

EXAMPLES = int(os.environ.get("GEOMOPT_REGEX_EXAMPLES", "300"))
# derandomized: every run draws the same patterns and names (a run is reproducible, in CI too)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)

# Characters where Python's and RE2's readings part: line breaks, Unicode spaces and digits, case
# folding beyond ASCII (Kelvin sign, long s, sharp s, dotted and dotless i, final sigma), lone
# surrogates and U+FFFD (which once stood in for them), a character beyond the BMP, NUL.
CHARS = ["a", "b", "k", "K", "\u212a", "s", "S", "\u017f", "\xdf", "\u1e9e", "i", "I", "\u0130", "\u0131",
         "\xe9", "\xc9", "\u03c3", "\u03c2", "\u03a3", "1", "\u0663", "_", ".", " ", "\n", "\t", "\x85",
         "\u2028", "\u3000", "\ufffd", "\ud800", "\udfff", "\U0001d7d8", "\x00", "-", "z"]
LITERALS = ["a", "b", "k", "K", "s", "\xe9", "\xdf", "\u0130", "\u0131", "\u03c3", "1", "_", r"\.", r"\n", " ",
            r"\ufffd", r"\ud800", r"\u212a", r"\x85", "-", r"\-", "\\\xe9", r"\t", r"\0", r"\U0001d7d8"]
CLASSES = [".", r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "[ab]", "[^a]", "[a-z]", "[^.]", r"[\s.]", r"[^\W\d]",
           r"[\D]", r"[\W_]", r"[\ud800-\udfff]", r"[^\ud800]", r"[\x00-\ud7ff]", "[\xe9-\xff]", r"[\n]", r"[^\n]",
           "[K-k]", r"[\S\n]", r"[^\s\w]", "[]a]", r"[\b]"]
ANCHORS = ["^", "$", r"\A", r"\Z", r"\b", r"\B", r"$\n", r"\Z\n?", r"$\s*", r"(?:$|\n)", r"(?m:$)\n", r"\n^"]
# Constructs RE2 lacks: each refused (GO007), never run otherwise.
LACKING = [r"(a)\1", "(?P<g>a)(?P=g)", "(?=a)", "(?!a)", "(?<=a)", "(?<!a)", "(?>a)", "a*+", "a?+", "(?(1)a|b)"]
QUANTIFIERS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{,2}", "{0}", "{2,}", "{0,1}?"]
SCOPES = ["(?i:", "(?s:", "(?m:", "(?a:", "(?-i:", "(?x:", "(", "(?:", "(?P<n>"]
GLOBAL = ["", "", "", "(?i)", "(?m)", "(?s)", "(?a)", "(?ims)", "(?ai)", "(?x)"]


def _extend(children):
    return st.one_of(
        st.lists(children, min_size=2, max_size=4).map("".join),
        st.lists(children | st.just(""), min_size=2, max_size=3).map(lambda arms: "(?:" + "|".join(arms) + ")"),
        st.tuples(st.sampled_from(SCOPES), children).map(lambda t: t[0] + t[1] + ")"),
        st.tuples(children, st.sampled_from(QUANTIFIERS)).map(lambda t: "(?:" + t[0] + ")" + t[1]),
        st.tuples(st.sampled_from(LITERALS + CLASSES), st.sampled_from(QUANTIFIERS)).map("".join),
    )


ATOMS = st.sampled_from(3 * LITERALS + 3 * CLASSES + 4 * ANCHORS + LACKING)
REGEXES = st.tuples(st.sampled_from(GLOBAL), st.recursive(ATOMS, _extend, max_leaves=8)).map("".join)
NAMES = st.tuples(st.lists(st.sampled_from(CHARS), max_size=7).map("".join), st.sampled_from(["", "", "\n"])).map(
    "".join)


def _python(regex: str):
    """Python's compiled regex, or None where Python refuses it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return re.compile(regex)
        except (re.error, OverflowError, RecursionError):
            return None


def _refused_where_written(pattern: str) -> None:
    """A refused pattern is a GO007 error at the pattern, in a spec, with a one-line message."""
    text = (f"geomopt: 1\nname: x\nrules:\n  - name: a\n    match: {json.dumps(pattern)}\n"
            f"    geometry: {{kind: euclidean}}\n")
    with pytest.raises(SpecError) as info:
        parse_spec(text, "yaml")
    (d,) = info.value.diagnostics
    assert (d.code, d.line, d.col) == ("GO007", 5, 12) and "\n" not in d.message


EVERY_CHARACTER = st.characters(codec=None, categories=None, exclude_categories=[])
TWINS = {"k": "K\u212a", "s": "S\u017f", "i": "I\u0130\u0131", "\xe9": "\xc9", "\u03c3": "\u03c2\u03a3",
         "\xdf": "\u1e9e", "1": "\u0663", " ": "\u3000\x85\n", "\n": " ", "\ufffd": "\ud800",
         chr(0xD800): "\ufffd"}  # (a literal "\ud800" key reads to ruff as U+FFFD)


MATCHING_MAX = 10  # longest drawn matching name (its near misses are one longer)


def _matching(regex: re.Pattern, data) -> list[str]:
    """Names Python's engine matches (drawn from the regex), and near misses: a line break added
    or dropped, a character swapped for its case twin, a space, a surrogate."""
    if regex.flags & re.ASCII or "(?a:" in regex.pattern:  # the generator trips on ASCII case folding
        return []
    try:
        strategy = st.from_regex(regex, fullmatch=True, alphabet=EVERY_CHARACTER)
        strategy.validate()
    except Exception:  # a construct the generator does not know: the grammar's names still run
        return []
    # short names only: Python's backtracking engine, the reference, takes time exponential in a
    # name's length on nested repeats (the generator's (?:(?:a+)+)+ over a long near miss)
    names = [n for n in data.draw(st.lists(strategy, max_size=3)) if len(n) <= MATCHING_MAX]
    near = [n + "\n" for n in names] + [n[:-1] for n in names]
    for n in names:
        for i, c in enumerate(n[:4]):
            near += [n[:i] + t + n[i + 1:] for t in TWINS.get(c.lower(), "")]
    return names + near


@FUZZ
@given(regex=REGEXES, names=st.lists(NAMES, min_size=1, max_size=8), data=st.data())
def test_regexes_mean_what_pythons_re_means_or_are_refused(regex, names, data):
    ref = _python(regex)
    error = pattern_error("re:" + regex)
    if error is not None:
        event("refused: " + ("Python refuses it" if ref is None else
                             next((c for c in LACKING if c in regex), error.split(": ", 1)[1][:40])))
        # refused only for what Python refuses, what RE2 lacks, or a mix of \b kinds
        assert ref is None or any(c in regex for c in LACKING) or "mixes Unicode and ASCII" in error, error
        if hash(regex) % 50 == 0:  # a spec per pattern would dominate the run; a sample shows the position
            _refused_where_written("re:" + regex)
        return
    event("accepted")
    assert ref is not None, regex
    names += _matching(ref, data)
    event("a name matches" if any(ref.fullmatch(n) for n in names) else "no name matches")
    compiled, on_re2 = compile_pattern("re:" + regex), _re2_matcher("re:" + regex, regex)
    for name in names:
        expected = ref.fullmatch(name) is not None
        assert (on_re2(name) is not None) == expected, (regex, name)
        assert (compiled.fullmatch(name) is not None) == expected, (regex, name, compiled.engine)


GLOB_ATOMS = ["*", "**", "?", "a", "b", ".", "**.", ".**", "\n", "\xe9", "[", "+", "\ufffd"]


def _reference_glob(pattern: str) -> re.Pattern:
    """A glob's meaning, spelled independently: ``**`` any run (line breaks included), ``**.``
    also no segment, a final ``.**`` also no segment, ``*`` a run without a dot, ``?`` a non-dot."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        for token, rx in (("**.", r"(?:.*\.)?"), (".**", r"(?:\..*)?"), ("**", ".*"), ("*", r"[^.]*"), ("?", "[^.]")):
            if pattern.startswith(token, i) and (token != ".**" or i + 3 == n):
                out.append(rx)
                i += len(token)
                break
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


@FUZZ
@given(glob=st.lists(st.sampled_from(GLOB_ATOMS), min_size=1, max_size=8).map("".join),
       names=st.lists(st.lists(st.sampled_from(["a", "b", ".", "\n", "\xe9", "[", "\ufffd", "\ud800"]),
                               max_size=10).map("".join), min_size=1, max_size=8))
def test_globs_mean_the_same_on_both_engines(glob, names):
    ref = _reference_glob(glob)
    compiled, on_re2 = compile_pattern(glob), _re2_matcher(glob, _glob_regex(_glob_tokens(glob)))
    event(compiled.engine)
    for name in names:
        expected = ref.fullmatch(name) is not None
        assert (compiled.fullmatch(name) is not None) == expected == (on_re2(name) is not None), (glob, name)


@pytest.mark.parametrize("regex, name", [
    (r"a$\n", "a\n"),  # `$` before a final line break
    (r"(?:a|aa)+$\n", "aa\n"),
    (r"(?s)$\s", "\n"),
    (r"(?:a$)+\n?", "aa\n"),
    (r"(?:a|\ufffd)+", "a\ud800"),  # a lone surrogate is no U+FFFD
    (r"(?:a|\ufffd)+", "a\ufffd"),
    (r"[\ud800-\udfff]b", "\udc80b"),
    (r"\bcaf\xe9\b", "caf\xe9"),  # Unicode \b
    (r"x\b", "x\xe9"),
    (r"x\B\w", "x\xe9"),
    (r"(?i)k", "\u212a"),  # Kelvin sign
    (r"(?i)\u0131", "I"),  # dotless i
    (r"(?i)[^k]", "\u212a"),
    (r"\d", "\u0663"),
    (r"\s", "\x1c"),
    (r"(?a)\w", "\xe9"),
    (r"a\Z\n?", "a\n"),
    (r"a\Z\n", "a\n"),  # \Z is the end only
    (r"\s\b", "\n"),  # after a final line break: no word boundary, a non-boundary
    (r"\s\B", "\n"),
    (r"(?:a$|b)+\n?", "ab\n"),
    (r"(?m)a$\n^b", "a\nb"),
    (r"(?x) a b  # a comment", "ab"),
    (r"a(?#a comment)b", "ab"),
    (r"\B", ""),
])
def test_where_re2_and_python_part_python_decides(regex, name):
    expected = re.fullmatch(regex, name) is not None
    assert pattern_error("re:" + regex) is None
    assert (_re2_matcher("re:" + regex, regex)(name) is not None) == expected
    assert (compile_pattern("re:" + regex).fullmatch(name) is not None) == expected


def test_the_line_break_cases_match_as_python_says():
    """The four cases of the trust report, by value (not only by agreement)."""
    assert compile_pattern(r"re:a$\n").fullmatch("a\n") is not None
    assert compile_pattern(r"re:(?:a|aa)+$\n").fullmatch("aa\n") is not None
    assert compile_pattern(r"re:(?s)$\s").fullmatch("\n") is not None
    assert compile_pattern(r"re:(?:a|\ufffd)+").fullmatch("a\ud800") is None
    assert compile_pattern(r"re:a$").fullmatch("a\n") is None  # `$` holds there, but the match must take "\n"


@pytest.mark.parametrize("glob, name", [("**", "a\nb"), ("h.**", "h.x\ny"), ("**.weight", "blocks.a\nb.weight"),
                                        ("**a**b**", "\na\n\nb\n"), ("*", "a\nb"), ("?", "\n")])
def test_double_star_crosses_line_breaks(glob, name):
    """A ModuleDict key may hold a line break: ``**`` matches it, on either engine."""
    assert compile_pattern(glob).fullmatch(name) is not None
    assert _re2_matcher(glob, _glob_regex(_glob_tokens(glob)))(name) is not None


@pytest.mark.parametrize("regex, words", [
    (r"(a)\1", "backreferences"), ("(?=a)a", "lookaround"), ("(?<!x)a", "lookaround"), ("(?>a)", "atomic"),
    ("a*+", "possessive"), ("(a)?(?(1)a|b)", "conditionals"), ("a{1001}", "at most 1000"),
    (r"\b(?a:\b)", "mixes Unicode and ASCII"),
])
def test_what_re2_cannot_mean_is_refused_with_what_to_write(regex, words):
    error = pattern_error("re:" + regex)
    assert error is not None and words in error and "\n" not in error
    _refused_where_written("re:" + regex)
