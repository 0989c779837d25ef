"""The ``geomopt`` command's exit statuses, and the user mistake that exits 2.

Exit status, as linters do: 0 clean, 1 findings at error level (or warnings with ``--strict``),
2 usage error or unreadable input. A :class:`UsageError` is printed as one line,
``geomopt COMMAND: error: MESSAGE``, never as a traceback. Its own module, so that the commands
that live apart from :mod:`geomopt.cli.main` (lock, demo, bench) raise it without importing main,
which imports them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake in how the command was called (bad --model, missing file …): exit 2."""


def write_output(path: Union[str, os.PathLike], text: str, option: str = "-o") -> None:
    """Write ``text`` to the file ``path`` (UTF-8); an OSError (no such folder, a full disk, a
    directory, a read-only file, a name too long) is a :class:`UsageError` naming the file, the
    reason and what ``option`` needs."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {os.fspath(path)}: {exc.strerror or exc}; give {option} a writable file in "
                         f"an existing folder") from None
