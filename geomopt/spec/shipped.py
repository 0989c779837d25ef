"""Where the shipped files live: the spec files (``specs/``: :func:`geomopt.shipped_specs`) and the
DSL grammar (``grammars/geomopt.lark``). Both are folders at the repository's top level, where they
are browsed and copied; the wheel installs them inside the package, as ``geomopt/specs/`` and
``geomopt/grammars/`` (pyproject.toml's ``package-dir``). An installed wheel reads them there, a
source checkout (an editable install, or the checkout on ``PYTHONPATH``) at the top level."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # geomopt/, installed or in the checkout


def shipped_folder(name: str) -> Path:
    """The shipped folder ``name`` (``"specs"`` or ``"grammars"``): inside the installed package,
    else at the top of the source checkout the package runs from."""
    for folder in (PACKAGE / name, PACKAGE.parent / name):
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"geomopt's shipped {name}/ folder is missing: neither {PACKAGE / name} (an installed "
                            f"wheel) nor {PACKAGE.parent / name} (a source checkout) exists; reinstall geomopt")
