"""Which parameters a rule owns: whole-name globs and regexes, module class, ndim, shape.

Names match whole (``layers.1`` never matches ``layers.10``; ``head`` never ``decode_head``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

from geomopt.spec.model import Match


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """What the compiler knows of a tensor: names, shape, dtype, owning module classes.

    ``modules`` holds the owning module's class name and its base classes' (so ``module: Linear``
    also owns ``NonDynamicallyQuantizableLinear``); None when unknown (a checkpoint).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    requires_grad: bool = True
    modules: Optional[tuple[str, ...]] = None
    aliases: tuple[str, ...] = ()  # other names of the same (tied) tensor
    device: str = "cpu"

    @property
    def ndim(self) -> int:
        return len(self.shape)


@functools.lru_cache(maxsize=4096)
def glob_regex(pattern: str) -> re.Pattern:
    """Glob on dotted names: ``*`` within a segment, ``**`` across segments, ``?`` one character;
    ``re:…`` is a full-match regular expression."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    out, i, n = [], 0, len(pattern)
    while i < n:
        if pattern.startswith("**.", i):
            out.append(r"(?:.*\.)?")  # zero or more leading segments
            i += 3
        elif pattern.startswith(".**", i) and i + 3 == n:
            out.append(r"(?:\..*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def matches(match: Match, p: ParamInfo) -> Optional[bool]:
    """True / False, or None when a module predicate cannot be decided (no module information).

    A tied tensor matches a name pattern if any of its names does."""
    if match.name is not None and not any(glob_regex(match.name).fullmatch(n) for n in (p.name, *p.aliases)):
        return False
    if match.ndim is not None and p.ndim not in (match.ndim if isinstance(match.ndim, list) else [match.ndim]):
        return False
    if match.shape is not None and (
        len(match.shape) != p.ndim or any(s != "*" and s != d for s, d in zip(match.shape, p.shape))
    ):
        return False
    if match.module is not None:
        if p.modules is None:
            return None
        return match.module in p.modules
    return True


def describe(match: Match) -> str:
    parts = []
    if match.name is not None:
        parts.append(repr(match.name))
    if match.module is not None:
        parts.append(f"module={match.module}")
    if match.ndim is not None:
        parts.append(f"ndim={match.ndim}")
    if match.shape is not None:
        parts.append(f"shape={list(match.shape)}")
    return " ".join(parts)
