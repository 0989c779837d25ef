"""The documentation: every Python block of the cookbook and the migration pages runs as written,
the generated pages (docs/hooks/generate.py) cover every kind and every lint rule, and the README
stays short. `mkdocs build --strict` itself runs in CI (.ci/run), with the docs extra."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = sorted([*(DOCS / "cookbook").glob("*.md"), *(DOCS / "migration").glob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_python_blocks_run(page, monkeypatch, tmp_path):
    """A page's blocks run in order in one namespace (later blocks use what earlier ones built),
    from an empty working directory."""
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for k, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page.relative_to(ROOT)} (python block {k + 1})", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{page.relative_to(ROOT)}: python block {k + 1} failed: {exc!r}\n{block}") from exc


def test_every_cookbook_and_migration_page_has_code():
    assert {p.stem for p in (DOCS / "cookbook").glob("*.md")} >= {
        "llama-muon", "moe", "vit", "resnet", "scion", "spectral-clipping", "stiefel"}
    assert {p.stem for p in (DOCS / "migration").glob("*.md")} >= {"torch-muon", "timm-muon", "scion", "dion"}
    for page in RUNNABLE:
        if page.stem != "index":
            assert python_blocks(page), f"{page.relative_to(ROOT)} has no python block"


# ---------------------------------------------------------------- generated pages


@pytest.fixture(scope="module")
def generated():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "hooks" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_generate"] = module
    try:
        spec.loader.exec_module(module)
        yield module, module.pages()
    finally:
        sys.modules.pop("docs_generate", None)


def test_a_page_per_lint_rule(generated):
    module, pages = generated
    rules = module.lint_rules()
    assert rules and {f"lint/{code}.md" for code in rules} <= set(pages)
    for code, rule in rules.items():
        page = pages[f"lint/{code}.md"]
        assert page.startswith(f"# {code} {rule.name}\n") and "## What it does" in page
        for heading in ("## Why is this bad?", "## Example", "## Use instead", "## How to suppress it"):
            assert heading in page, (code, heading)  # ruff's form (tests/test_lint_pages.py checks the examples)
        assert f"[{code}]({code}.md)" in pages["lint/index.md"]


def test_rule_docstring_parts_are_parsed(generated):
    module, _ = generated
    parts = module.parse_rule_doc("""A thing that is wrong. It matters because of this.

    Bad: ``x: 1``. Fixed: ``x: 2``.
    """)
    assert parts["what"] == "A thing that is wrong." and parts["why"] == "It matters because of this."
    assert parts["parts"] == [("bad", "`x: 1`."), ("fixed", "`x: 2`.")]
    with pytest.raises(ValueError, match="Bad"):
        module.parse_rule_doc("A rule without an example.")
    with pytest.raises(ValueError, match="a why"):
        module.parse_rule_doc("A thing that is wrong.\n\nBad: ``x: 1``.")


def test_every_kind_of_every_field_is_documented(generated):
    module, pages = generated
    for cat in module.categories():
        page = pages[f"reference/{cat.slug}.md"]
        for model in cat.models:
            kind = model.model_fields["kind"].default
            assert f"## `{kind}` {{#{kind}}}" in page, (cat.slug, kind)
        assert page.count('=== "YAML"') == len(cat.models) and page.count('=== "DSL"') == len(cat.models)
    from geomopt.spec.model import Match

    assert all(f"`{name}`" in pages["reference/match.md"] for name in Match.model_fields)
    assert "## Spec {#spec}" in pages["reference/hyper-parameters.md"]


def test_examples_are_printed_by_the_printer_and_parse_back(generated):
    module, _ = generated
    text_yaml, text_dsl = module.example(module._rule(constraint={"kind": "rank", "k": 4},
                                                      geometry={"kind": "spectral", "reference": {"kind": "indicator"}}))
    assert "constraint: {kind: rank, k: 4}" in text_yaml and "constraint rank(k=4)" in text_dsl


def test_layout_lists_every_package(generated):
    module, _ = generated
    text = module.layout()
    for pkg in sorted(p.parent for p in (ROOT / "geomopt").rglob("__init__.py")):
        name = ".".join(pkg.relative_to(ROOT).parts)
        assert f"`{name}`" in text, name


# ---------------------------------------------------------------- README and the checkout


def test_readme_is_short_and_keeps_its_set_up_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)
    text = "\n".join(lines)
    assert 'pip install torch==2.13.0 && pip install -e ".[examples]" && geomopt demo' in text
    assert ('pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps torchtitan==0.3.0 '
            '&& python -m pytest -q -n 2\n') in text
    # CI runs the same command (without pytest's cache folder)
    assert "\npython3 -m pytest -q -n 2 -p no:cacheprovider\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_no_symlinks_at_the_root():
    """Symlinks break Windows checkouts: specs/ and grammars/ are real folders, which the wheel installs
    inside the package (pyproject.toml's package-dir)."""
    assert not [p.name for p in ROOT.iterdir() if p.is_symlink()]
