"""The package's layers, by an AST scan of geomopt/: compile owns matching, roles and the plan and
never imports lint (lint reads compile); inside compile, the tracer (compile.trace) and role
inference (compile.roles) import down only, never matching's owners or the plan; each name is
imported from the module that defines it (only the public packages re-export); no module imports
another's underscore names; each module name means one concept (one registry.py, and "catalog" is
the shipped specs only).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "geomopt"
#: the packages whose ``__init__`` is public API (docs/guide/python.md, api.md) and may re-export
PUBLIC_PACKAGES = {"geomopt", "geomopt.spec", "geomopt.compile", "geomopt.lint", "geomopt.optim", "geomopt.geometry",
                   "geomopt.distributed", "geomopt.models"}


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(encoding="utf-8"))


def _imports(module: str):
    """(node, absolute module or None for ``import x``) of every import in ``module``, at any depth."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield node, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node, node.module
        elif isinstance(node, ast.Import):
            yield node, None


@cache
def _defined(module: str) -> frozenset:
    """The names ``module`` binds at top level other than by importing from geomopt."""
    out = set()
    for node in _tree(module).body:
        for stmt in [node, *getattr(node, "body", []), *getattr(node, "orelse", [])]:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(stmt, ast.ImportFrom) and not (stmt.module or "").startswith("geomopt"):
                out.update(a.asname or a.name for a in stmt.names)
            elif isinstance(stmt, ast.Import):
                out.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return frozenset(out)


def _all(module: str) -> list[str]:
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    return []


def test_the_scan_sees_the_package():
    assert {"geomopt.compile.compiler", "geomopt.lint.context", "geomopt.spec.model"} <= set(MODULES)
    found = {m for _, m in _imports("geomopt.lint.context")}
    assert "geomopt.compile.ownership" in found  # lint reads compile


def test_compile_never_imports_lint():
    edges = [f"{m}:{node.lineno} imports {target or ast.unparse(node)}"
             for m in MODULES if m.startswith("geomopt.compile")
             for node, target in _imports(m)
             if (target or "").startswith("geomopt.lint")
             or any(a.name.startswith("geomopt.lint") for a in node.names)
             or (target == "geomopt" and any(a.name == "lint" for a in node.names))]
    assert edges == []


#: what each subpackage of compile may import of compile outside itself: the tracer reads parameter names
#: only; roles read the trace and matching's records and patterns; ownership, blocking, resolution, the plan,
#: the lock and explain read roles, never the other way
COMPILE_LAYERS = {
    "geomopt.compile.trace": {"geomopt.compile.wrappers"},
    "geomopt.compile.roles": {"geomopt.compile.trace", "geomopt.compile.match"},
}


def _compile_targets(module: str):
    """(line, module of geomopt.compile) of every import of ``module`` that reaches compile, submodules
    named in ``from geomopt.compile… import x`` resolved to themselves."""
    for node, target in _imports(module):
        if target is None:
            names = [a.name for a in node.names]
        else:
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        yield from ((node.lineno, n) for n in names if n.startswith("geomopt.compile"))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("layer", sorted(COMPILE_LAYERS))
def test_compile_subpackages_import_down_only(layer):
    allowed = COMPILE_LAYERS[layer] | {layer}
    members = [m for m in MODULES if _inside(m, layer)]
    assert len(members) > 3, members  # the subpackage is where the scan looks
    found = [f"{m}:{line} imports {target}" for m in members for line, target in _compile_targets(m)
             if not any(_inside(target, a) for a in allowed)]
    assert found == []


def test_the_compile_layer_scan_sees_the_edges_it_allows():
    """The scan reads the imports the layering is about (a check that sees none would pass anything)."""
    seen = {(layer, target) for layer in COMPILE_LAYERS for m in MODULES if _inside(m, layer)
            for _, target in _compile_targets(m)}
    assert ("geomopt.compile.roles", "geomopt.compile.trace.forward") in seen
    assert ("geomopt.compile.roles", "geomopt.compile.match") in seen
    assert ("geomopt.compile.trace", "geomopt.compile.wrappers") in seen


def test_importing_compile_loads_no_lint():
    code = ("import sys, geomopt.compile, geomopt.compile.blocking, geomopt.compile.explain; "
            "bad = [m for m in sys.modules if m.startswith('geomopt.lint')]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_no_module_imports_another_modules_private_names():
    found = [f"{m}:{node.lineno} from {target} import {a.name}"
             for m in MODULES for node, target in _imports(m)
             if target is not None and target.startswith("geomopt") and target != m
             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_each_name_comes_from_the_module_that_defines_it():
    """``from geomopt.x import name``: ``name`` is defined in geomopt.x (or is its submodule)."""
    found = []
    for m in MODULES:
        for node, target in _imports(m):
            if not isinstance(node, ast.ImportFrom) or target not in MODULES:
                continue
            for a in node.names:
                if a.name not in _defined(target) and f"{target}.{a.name}" not in MODULES:
                    found.append(f"{m}:{node.lineno} from {target} import {a.name}")
    assert found == []


def test_only_the_public_packages_re_export():
    found = {}
    for m in MODULES:
        imported = {a.asname or a.name for node, target in _imports(m) if (target or "").startswith("geomopt")
                    for a in node.names}
        re_exported = [n for n in _all(m) if n in imported]
        redundant = [a.name for node, _ in _imports(m) for a in node.names if a.asname == a.name.rpartition(".")[2]]
        lines = MODULES[m].read_text(encoding="utf-8").splitlines()
        redundant += [f"{a.name} (noqa: F401)" for node, target in _imports(m)
                      if (target or "").startswith("geomopt") and "noqa: F401" in lines[node.end_lineno - 1]
                      for a in node.names if f"{target}.{a.name}" not in MODULES and m not in PUBLIC_PACKAGES]
        if (re_exported and m not in PUBLIC_PACKAGES) or redundant:
            found[m] = re_exported + redundant
    assert found == {}


def test_the_public_packages_are_documented():
    docs = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md")) + (
        ROOT / "README.md").read_text(encoding="utf-8")
    assert [p for p in PUBLIC_PACKAGES if f"{p}" not in docs and p != "geomopt"] == []


@pytest.mark.parametrize("stem", ["registry", "catalog"])
def test_one_module_per_name(stem):
    paths = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob(f"{stem}.py"))
    assert paths == (["geomopt/registry.py"] if stem == "registry" else [])
    assert (ROOT / "specs" / "catalog").is_dir()  # the catalogue of shipped specs keeps the name


def _module_graph() -> dict[str, set[str]]:
    """module → the geomopt modules it imports, at any depth (inside functions and under
    ``TYPE_CHECKING`` too): ``from pkg import name`` counts as an import of ``pkg.name`` where
    that is a module, else of ``pkg``."""
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        out = graph.setdefault(m, set())
        for node, target in _imports(m):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in MODULES)
            elif target in MODULES:
                out.update(f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_counting_lazy_and_type_checking_imports():
    assert _cycles(_module_graph()) == []
    # the check sees a circle where there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _own_private_attributes() -> set[str]:
    """The underscore attributes geomopt's own code assigns (``x._name = …``)."""
    out = set()
    for m in MODULES:
        for node in ast.walk(_tree(m)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            out.update(t.attr for t in targets if isinstance(t, ast.Attribute) and t.attr.startswith("_")
                       and not t.attr.startswith("__"))
    return out


def test_no_module_reads_another_objects_private_attributes():
    """An object's underscore attributes are read through ``self`` only: the optimizer's engine,
    the spec's positions and the tracer's tables have public interfaces (torch's own private
    attributes that geomopt assigns, the optimizer's hooks, are read by the optimizer itself)."""
    own = _own_private_attributes()
    assert "_building" in own and "_source" in own  # the scan sees the attributes geomopt keeps
    found = [f"{m}:{node.lineno} {ast.unparse(node)}" for m in MODULES for node in ast.walk(_tree(m))
             if isinstance(node, ast.Attribute) and node.attr in own
             and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert found == []
