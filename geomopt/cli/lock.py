"""``geomopt plan SPEC --model … --lock FILE | --check FILE``: write a plan's routing lock, or compare
the plan with one (exit 0 unchanged, 1 with the diff, 2 for a lock that cannot be read or written).

The lock itself (format, reading, diff) is :mod:`geomopt.compile.lock`; this is only the command's
side: which model name goes into the header, where the output goes, and the exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path

from geomopt.cli.status import EXIT_CLEAN, EXIT_FINDINGS, UsageError
from geomopt.compile.lock import LockError, diff, lock_of, read_lock, write_lock
from geomopt.optim.persist.checkpoint import spec_hash


def lock_or_check(args, spec, plan) -> int:
    """``--lock``: write the lock and say where (stderr); ``--check``: the diff on stdout and exit 1
    when the routing changed, a one-line confirmation on stderr and exit 0 when not."""
    # --model: the class (set by _params); --checkpoint: the file's name
    model = getattr(args, "model_label", None) or (Path(args.checkpoint).name if args.checkpoint else None)
    current = lock_of(plan, spec_hash(spec), model)
    if args.lock:
        try:
            write_lock(current, args.lock)
        except OSError as exc:
            raise UsageError(f"cannot write lock {args.lock}: {exc.strerror or exc}; give --lock a writable file in an "
                             f"existing folder") from None
        print(f"wrote {args.lock}: {len(current.routes)} tensors, spec {current.spec_name!r}"
              + (f", model {model}" if model else ""), file=sys.stderr)
        return EXIT_CLEAN
    try:
        d = diff(read_lock(args.check), current)
    except LockError as exc:
        raise UsageError(str(exc)) from None
    if d:
        print(d.format())
        return EXIT_FINDINGS
    print("\n".join([d.summary()] + [f"note: {n}" for n in d.notes]), file=sys.stderr)
    return EXIT_CLEAN
