"""A/B of two versions of geomopt in one process: this tree against a git commit's package.

    python benchmarks/ab.py --base COMMIT [--model gpt2-small] [--spec specs/muon.yaml] [--device cuda] [--fuse]

The base commit's ``geomopt`` package is extracted (``git archive``) into a temporary folder and
imported under the name ``geomopt_base``, so both versions, torch.optim.Muon and (on CUDA) both
with ``cuda_graphs=True`` step on copies of the same tensors, round-robin: the machine's drift
hits every row alike, which is what makes a before/after figure trustworthy on a shared GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name, hidden_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def import_base(commit: str, into: Path, name: str = "geomopt_base"):
    """The ``geomopt`` package of ``commit``, importable as ``name`` (with its shipped specs and
    grammar inside it, as a wheel installs them, wherever the commit keeps them)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit], check=True,
                            capture_output=True, text=True).stdout.split()
    folders = ["geomopt"] + [f for f in ("specs", "grammars") if f in listed]
    data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *folders], check=True,
                          capture_output=True).stdout
    into = into / name  # a folder per copy: two copies of one commit are two packages
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / name
    (into / "geomopt").rename(pkg)
    for folder in folders[1:]:
        (into / folder).rename(pkg / folder)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom geomopt([ .])", rf"from {name}\1", text)
        text = re.sub(r"\bimport geomopt\b", f"import {name}", text)
        text = text.replace('files("geomopt")', f'files("{name}")')
        path.write_text(text.replace('"geomopt.', f'"{name}.'))
    sys.path.insert(0, str(into))
    for mod in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[mod]  # an earlier call's, from a folder since deleted
    return importlib.import_module(name)


@contextlib.contextmanager
def importable_warnings(*names: str):
    """The block's warnings, issued again when it ends, each whose class lives in a copy (a module
    under one of ``names``) as its nearest base class outside the copies, the copy's class named in
    its text (RolesGuessedWarning(UserWarning) → UserWarning "RolesGuessedWarning: …"): a copy
    imports in this process only, and whoever reads a warning in another imports its class by
    module name (pytest-xdist's controller does, for its workers' warnings). The others are issued
    again as they were; the caller's filters apply to all of them then."""
    def copied(cls: type) -> bool:
        return cls.__module__.split(".")[0] in names

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        category, message = w.category, w.message
        if copied(category):
            category = next(c for c in category.__mro__ if not copied(c))
            message = category(f"{w.category.__name__}: {w.message}")
        warnings.warn_explicit(message, category, w.filename, w.lineno or 0, source=w.source)


#: glibc's allocator with a fixed mmap threshold and no trimming: with its default (a threshold
#: that moves with the process's history of frees) a step's large temporaries are sometimes fresh
#: mmaps, page-faulted in every step, and which version gets them changed from run to run: the same
#: comparison measured 0.95x and 1.05x; fixed, every row stepped 15-20% faster and the spread fell
#: to about 1.5% (2-core x86_64, 2026-11-26)
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "100000000000",
                 "MALLOC_TOP_PAD_": "1000000000"}


def main(argv=None) -> int:
    if argv is None and any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):  # glibc reads them at start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git commit (or ref) to compare against")
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--spec", default=str(ROOT / "specs" / "muon.yaml"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fuse", action="store_true",
                   help="every version with fuse=True (the elementwise tails compiled: compiles in the warm-up); "
                        "the base must have it")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    p.add_argument("--no-torch", action="store_true",
                   help="leave torch.optim.Muon out (its Newton–Schulz runs in bf16, which a CPU without native "
                        "bf16 emulates: seconds per step)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, importable_warnings("geomopt_base", "geomopt_again"):
        base = import_base(args.base, Path(tmp))
        again = import_base(args.base, Path(tmp), "geomopt_again")  # its own module-level caches
        _, fresh = hidden_workload(args.model, args.device, torch.float32)
        rows = [] if args.no_torch else [
            ("torch.optim.Muon", lambda ps: torch.optim.Muon([q for _, q in ps], lr=0.02, weight_decay=0.1,
                                                             momentum=0.95, nesterov=True))]
        extra = {"fuse": True} if args.fuse else {}
        tag = ", fuse=True" if args.fuse else ""
        rows += [(f"base {args.base}{tag}", lambda ps: base.GeomOptimizer(ps, args.spec, **extra)),
                 (f"this tree{tag}", lambda ps: geomopt.GeomOptimizer(ps, args.spec, **extra)),
                 (f"base {args.base}, again{tag}", lambda ps: again.GeomOptimizer(ps, args.spec, **extra))]
        if torch.device(args.device).type == "cuda":
            rows += [(f"base {args.base}, graphs", lambda ps: base.GeomOptimizer(ps, args.spec, cuda_graphs=True)),
                     ("this tree, graphs", lambda ps: geomopt.GeomOptimizer(ps, args.spec, cuda_graphs=True))]
        opts = [(name, make(fresh())) for name, make in rows]
        timer = Timer(args.device)
        for _ in range(3):
            for _, opt in opts:
                opt.step()
        times: dict = {name: [] for name, _ in opts}
        for k in range(args.iters):
            # the order reverses every round (a fixed order favoured one position by up to 6% on a
            # 2-core CPU: the same code measured 1.06x against itself)
            for name, opt in (opts if k % 2 == 0 else opts[::-1]):
                times[name] += timer(opt.step, 0, 1)
    muon = statistics.median(times["torch.optim.Muon"]) if "torch.optim.Muon" in times else None
    ref = statistics.median(times[f"base {args.base}{tag}"])
    lines = [f"### A/B: {Path(args.spec).name} on {args.model}, {device_name(args.device)}, torch {torch.__version__}"
             f" — {datetime.date.today().isoformat()}", "", "| optimizer | step (ms, median) | × torch Muon | × base |",
             "|---|---|---|---|"]
    for name, _ in opts:
        ms = statistics.median(times[name])
        lines.append(f"| {name} | {ms:.2f} | {f'{ms / muon:.3f}' if muon else '–'} | {ms / ref:.3f} |")
    emit("\n".join(lines), args.record, section_for(args.device, "A/B against a base commit"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
