"""The lint rules' pages (docs/hooks/generate.py) in ruff's form, their examples checked here, apart
from the generator: each page's bad spec and its fix are the rule's lint fixtures verbatim (less the
test header); the bad spec reports the rule's code, the fix does not and reports nothing the bad one
did not; the findings a page lists are what lint reports; and the page's way to suppress the finding
does silence it on the bad spec (or, for a blocking error, does not)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import geomopt
from geomopt.compile.blocking import BLOCKING
from geomopt.lint import RULES, lint_spec
from test_lint_fixtures import HEADER, HERE, read_fixture, target_params

ROOT = Path(__file__).resolve().parents[1]
CODES = sorted(RULES)
BLOCK = re.compile(r"```(\w+)\n(.*?)```\n", re.S)


@pytest.fixture(scope="module")
def pages():
    spec = importlib.util.spec_from_file_location("docs_generate_lint", ROOT / "docs" / "hooks" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_generate_lint"] = module
    try:
        spec.loader.exec_module(module)
        rules = module.lint_rules()
        yield {code: module.rule_page(rules[code]) for code in CODES}
    finally:
        sys.modules.pop("docs_generate_lint", None)


def section(page: str, heading: str) -> str:
    return page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def shown(text: str) -> tuple[str, list[str]]:
    """(the spec a section shows, the findings it says lint reports for it)."""
    before, after = text.split("`geomopt lint` reports", 1)
    spec = BLOCK.findall(before)[-1][1]
    if after.startswith(" nothing."):
        return spec, []
    lang, findings = BLOCK.findall(after)[0]
    assert lang == "text"
    return spec, findings.splitlines()


def lint_text(text: str, suffix: str, target: str):
    params, from_checkpoint = target_params(target)
    spec = geomopt.parse_spec(text, "dsl" if suffix == ".geom" else "yaml", file=f"example{suffix}")
    return lint_spec(spec, params, from_checkpoint=from_checkpoint, text=text)


def body(path: Path) -> str:
    """The fixture less its header (the leading ``# key: value`` lines, tests/lint_fixtures/README.md)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    n = 0
    while n < len(lines) and HEADER.match(lines[n]):
        n += 1
    return "".join(lines[n:])


@pytest.mark.parametrize("code", CODES)
def test_page_examples_are_fixtures_that_fire_and_are_fixed(pages, code):
    page = pages[code]
    note = page.split("\n\n")[1]  # "*Generated from … its lint fixtures (`tests/lint_fixtures/…`, …); do not edit.*"
    bad, fixed = (read_fixture(HERE / name) for name in re.findall(r"`tests/lint_fixtures/([^`]+)`", note))
    assert (bad.code, bad.kind, fixed.code, fixed.kind) == (code, "fail", code, "pass")
    assert fixed.path.name == bad.path.name.replace("-fail.", "-pass.")
    found = {}
    for heading, fx in (("Example", bad), ("Use instead", fixed)):
        spec, listed = shown(section(page, heading))
        assert spec == body(fx.path), (code, heading)
        diags = lint_text(spec, fx.path.suffix, fx.target)
        assert listed == [d.format() for d in diags], (code, heading)
        found[heading] = diags
    bad_codes, fixed_codes = ({d.code for d in found[h]} for h in ("Example", "Use instead"))
    assert code in bad_codes and code not in fixed_codes and fixed_codes <= bad_codes, (bad_codes, fixed_codes)


@pytest.mark.parametrize("code", CODES)
def test_page_says_how_to_suppress_and_that_works(pages, code):
    text = section(pages[code], "How to suppress it")
    bad = read_fixture(HERE / re.findall(r"`tests/lint_fixtures/([^`]+)`", pages[code])[0])
    spec = body(bad.path)
    lines = spec.splitlines(keepends=True)
    if code == "GO123":
        assert "`# geomopt: disable-file=GO123`" in text
        silenced = "# geomopt: disable-file=GO123\n" + spec
    else:
        assert f"`# geomopt: disable={code}`" in text and f"`geomopt lint --ignore {code}`" in text
        at = {d.line for d in lint_text(spec, bad.path.suffix, bad.target) if d.code == code}
        silenced = "".join(line.rstrip("\n") + f"  # geomopt: disable={code}\n" if k + 1 in at else line
                           for k, line in enumerate(lines))
    after = {d.code for d in lint_text(silenced, bad.path.suffix, bad.target)}
    if code in BLOCKING:
        assert "It cannot be" in text and code in after and "GO123" in after, after
    else:
        assert code not in after and "GO123" not in after, after
