"""Loading a script of the repository (scripts/, benchmarks/) as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path: Path, name: str):
    """The module of the script at ``path``, imported under ``name`` (registered while it executes:
    dataclasses resolve annotations through sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module
