"""The README's test command, timed: total wall time and the ten slowest tests, for this checkout
and (``--base COMMIT``) a commit's tree run right before it on the same machine.

    python benchmarks/suite.py [--base COMMIT] [--record NOTE] [-- PYTEST ARGS]

Each tree runs ``python -m pytest -q -n 2 -p no:cacheprovider --durations=10`` (two pytest-xdist
workers) in its own folder with ``PYTHONPATH`` set to it, so the tests and every subprocess they
start import that tree's package; a commit's tree is a fresh ``git clone`` checked out at the commit. Timings move with
the machine's load: compare rows taken back to back.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_suite(tree: Path, extra: list[str]) -> dict:
    """Wall seconds, the summary line and the ten slowest (seconds, phase, test) of one run."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "--durations=10", *extra]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    out = proc.stdout
    slowest = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", out, flags=re.M)
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return {"wall": wall, "rc": proc.returncode, "summary": summary[-1].strip("= ") if summary else "?",
            "slowest": [(float(s), phase, test) for s, phase, test in slowest]}


def checkout(commit: str) -> Path:
    where = Path(tempfile.mkdtemp(prefix="geomopt-suite-")) / "tree"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    subprocess.run(["git", "-C", str(where), "checkout", "-q", commit], check=True)
    return where


def table(name: str, r: dict) -> list[str]:
    lines = [f"**{name}**: {r['wall'] / 60:.0f} min {r['wall'] % 60:.0f} s wall ({r['summary']}; exit {r['rc']})", "",
             "| s | phase | test |", "|---|---|---|"]
    lines += [f"| {s:.2f} | {phase} | `{test}` |" for s, phase, test in r["slowest"]]
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="git commit to run first, from a fresh clone")
    p.add_argument("--record", metavar="NOTE", help="record the tables in benchmarks/RESULTS.md with this note")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. a test file)")
    args = p.parse_args(argv)
    import platform

    import torch

    runs = []
    if args.base:
        runs.append((f"base {args.base}", run_suite(checkout(args.base), args.pytest_args)))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    runs.append((f"this tree ({head}{' + changes' if _dirty() else ''})", run_suite(ROOT, args.pytest_args)))
    lines = [f"### Test suite (`python -m pytest -q -n 2`), {platform.machine()} CPU, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, Python {platform.python_version()} — {datetime.date.today().isoformat()}", ""]
    for name, r in runs:
        lines += table(name, r)
    emit("\n".join(lines).rstrip(), args.record, "Suite time")
    return 0 if all(r["rc"] == 0 for _, r in runs) else 1


def _dirty() -> bool:
    return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    sys.exit(main())
