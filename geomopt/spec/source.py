"""Source positions: both front ends return plain data plus a :class:`SourceMap`.

A path is a tuple of mapping keys and list indices from the document root, e.g.
``("rules", 0, "geometry", "kind")``. Positions are 1-based (line, col).
"""

from __future__ import annotations

import dataclasses
from typing import Any

Path = tuple
Pos = tuple[int, int]

MAX_BYTES = 1 << 20  # specs are small; a megabyte of spec is a mistake, not a spec
MAX_NODES = 100_000  # bounds alias expansion ("billion laughs") and pathological inputs
MAX_DEPTH = 64  # a spec nests about six deep; deeper is a mistake (and would exhaust the stack)


@dataclasses.dataclass
class SourceMap:
    """Where each value (and each mapping key) of a parsed spec came from."""

    file: str = "<spec>"
    values: dict = dataclasses.field(default_factory=dict)
    keys: dict = dataclasses.field(default_factory=dict)
    format: str = "yaml"

    def pos(self, path: Path, *, key: bool = False) -> Pos:
        """Position of ``path`` (its key if ``key``), else of the nearest recorded ancestor."""
        path = tuple(path)
        if key and path in self.keys:
            return self.keys[path]
        while path:
            if path in self.values:
                return self.values[path]
            if path in self.keys:
                return self.keys[path]
            path = path[:-1]
        return self.values.get((), (1, 1))


@dataclasses.dataclass
class Parsed:
    data: Any
    source: SourceMap
