"""Source positions: both front ends return plain data plus a :class:`SourceMap`; the bounds on
what is read (size, nodes, depth, integer digits; regular files only).

A path is a tuple of mapping keys and list indices from the document root, e.g.
``("rules", 0, "geometry", "kind")``. Positions are 1-based (line, col).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import IO, Any

Path = tuple
Pos = tuple[int, int]

MAX_BYTES = 1 << 20  # specs are small; a megabyte of spec is a mistake, not a spec
MAX_NODES = 100_000  # bounds alias expansion ("billion laughs") and pathological inputs
MAX_DEPTH = 64  # a spec nests about six deep; deeper is a mistake (and would exhaust the stack)
MAX_INT_DIGITS = 4300  # Python's default bound on int(str), fixed here whatever sys.set_int_max_str_digits says
_MAX_INT = 10 ** MAX_INT_DIGITS


def int_literal_error(value: int | None, digits: str = "") -> str | None:
    """Why an integer literal is refused (``digits``: its decimal digits, checked before
    conversion; ``value``: a hexadecimal or octal literal's value), or None."""
    if len(digits) > MAX_INT_DIGITS:
        what = f"too long ({len(digits):,} digits; at most {MAX_INT_DIGITS:,})"
    elif value is not None and abs(value) >= _MAX_INT:
        what = f"too large (more than {MAX_INT_DIGITS:,} decimal digits)"
    else:
        return None
    return f"integer literal {what}: no spec value needs so many; check the value"


class NotRegularFile(OSError):
    """A path that names a directory, a FIFO, a device or a socket, where a file was expected."""


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def check_regular(path) -> os.stat_result:
    """``path``'s status (links followed) if it is a regular file; raises OSError (missing,
    unreadable) or :class:`NotRegularFile`, whose ``strerror`` says what it is. Never opens it, so
    a FIFO does not block."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(0, f"{_kind(st.st_mode)}, not a regular file", str(path))
    return st


def open_regular(path) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file (links followed): opened without
    blocking (a FIFO would wait for a writer), then checked; raises like :func:`check_regular`."""
    check_regular(path)  # a clear error before opening a directory (Windows refuses to) or a device
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)  # what was opened: the path may have changed since
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(0, f"{_kind(st.st_mode)}, not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class FileTooLarge(OSError):
    """A regular file over the bound its reader sets; ``size``: its size in bytes, or None where
    the file said less than it held (a file in /proc, a file still being written)."""

    def __init__(self, size: int | None, limit: int, path):
        super().__init__(0, f"{size} bytes" if size is not None else f"over {limit} bytes", str(path))
        self.size, self.limit = size, limit


def read_regular(path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file (:func:`open_regular`) of at most ``limit`` bytes:
    refused by its size before it is read, and never more than ``limit`` + 1 bytes read (a size
    of 0 is what /proc reports for files of any length). Raises OSError, :class:`NotRegularFile` or
    :class:`FileTooLarge`."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileTooLarge(size, limit, path)
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise FileTooLarge(None, limit, path)
    return raw


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
