"""Wall time of ``geomopt lint`` (no model) in fresh processes, and whether it imported torch.

    python benchmarks/lint.py [--runs 5] [--size 1000000] [--quick] [--record NOTE]

Rows: the shipped ``specs/muon.yaml`` and ``muon.geom``, and generated YAML and DSL specs of
about ``--size`` bytes (the loader refuses more than 1 MiB) with thousands of rules that touch
every spec-only lint rule (findings included: the reporters' cost is part of a lint). Each figure
is the median wall time of ``python -m geomopt lint SPEC`` over ``--runs`` processes, start-up
and imports included, since that is what a user (or an editor on every save) waits for. The torch
column comes from one more run under ``python -X importtime``. ``--quick`` (the smoke test): one
run each on 20 kB specs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Rule bodies cycled through by the generators: (YAML flow fields, DSL items). Between them they
# give lint something to say (GO106 tiny eps, GO107 reference/approx mismatch, GO108 decay off a
# set, GO109 outside the theory) and keep the clean rules in the majority.
_BODIES = [
    ("geometry: {kind: adam, betas: [0.9, 0.95]}\n    lr: 0.001",
     "geometry adam(betas=[0.9, 0.95])\n    lr=0.001"),
    ("geometry: {kind: spectral, reference: {kind: indicator}, approx: {kind: newton_schulz, steps: 5}, "
     "prenormalize: {kind: max, eps: 1.0e-7}, scale: muon_original}",
     "geometry spectral(indicator, approx=newton_schulz, prenormalize=max, scale=muon_original)"),
    ("geometry: {kind: spectral, reference: {kind: log_barrier, eps: 1.0e-8}, approx: {kind: polar_express, "
     "steps: 5}}\n    constraint: {kind: frobenius_ball, radius: 0.5, relative: true}",
     "geometry spectral(log_barrier(eps=1e-08), approx=polar_express)\n"
     "    constraint frobenius_ball(radius=0.5, relative=true)"),
    ("geometry: {kind: isotropic, reference: {kind: log_barrier, eps: 1.0e-20}, scale: scion}",
     "geometry isotropic(log_barrier(eps=1e-20), scale=scion)"),
    ("geometry: {kind: spectral, reference: {kind: power_barrier, kappa: 4.0, eps: 1.0e-3}}\n"
     "    constraint: {kind: stiefel}\n    weight_decay: 0.1",
     "geometry spectral(power_barrier(kappa=4.0, eps=0.001))\n    constraint stiefel\n    weight_decay=0.1"),
    ("geometry: {kind: anisotropic, reference: {kind: indicator}, scale: scion}\n"
     "    constraint: {kind: linf_ball, radius: 2.0}",
     "geometry anisotropic(indicator, scale=scion)\n    constraint linf_ball(radius=2.0)"),
    ("geometry: {kind: euclidean, radius: 0.5}\n    direction: {kind: polyak, alpha: 0.1, nesterov: true}",
     "geometry euclidean(radius=0.5)\n    direction=polyak(alpha=0.1, nesterov=true)"),
]


def yaml_spec(size: int, tail: str = "") -> str:
    """A YAML spec of about ``size`` bytes (never more): rules ``layer_0``, ``layer_1`` …, then
    ``tail`` (text appended to the rules list), then a catch-all rule."""
    head = "geomopt: 1\nname: generated\ndefaults:\n  lr: 0.02\n  weight_decay: 0.0\nrules:\n"
    last = "  - name: rest\n    match: \"**\"\n    geometry: {kind: adam}\n"
    return _fill(head, last, tail, size, lambda i, body: (
        f"  - name: layer_{i}\n    match: {{name: \"blocks.{i}.*.weight\", ndim: 2}}\n    {body[0]}\n"))


def dsl_spec(size: int, tail: str = "") -> str:
    """The DSL twin of :func:`yaml_spec`."""
    head = "geomopt 1\nname \"generated\"\ndefaults lr=0.02 weight_decay=0.0\n\n"
    last = "rule rest match \"**\":\n    geometry adam\n"
    return _fill(head, last, tail, size, lambda i, body: (
        f"rule layer_{i} match name=\"blocks.{i}.*.weight\" ndim=2:\n    {body[1]}\n\n"))


def _fill(head: str, last: str, tail: str, size: int, rule) -> str:
    parts, n, i = [head], len(head) + len(last) + len(tail), 0
    while True:
        text = rule(i, _BODIES[i % len(_BODIES)])
        if n + len(text) > size:
            break
        parts.append(text)
        n += len(text)
        i += 1
    return "".join(parts) + tail + last


def lint_once(spec: Path, *, importtime: bool = False) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-m", "geomopt", "lint", str(spec)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - start, proc


def imports_torch(spec: Path) -> bool:
    """Whether ``geomopt lint SPEC`` imported torch (the importtime log names every module)."""
    _, proc = lint_once(spec, importtime=True)
    return any(line.split("|")[-1].strip() == "torch" for line in proc.stderr.splitlines()
               if line.startswith("import time:"))


def count(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.splitlines()
    n = {s: sum(f": {s} GO" in line for line in lines) for s in ("error", "warning", "note")}
    return f"{n['error']} / {n['warning']} / {n['note']}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--size", type=int, default=1_000_000, help="bytes of each generated spec (at most 1 MiB)")
    p.add_argument("--quick", action="store_true", help="one run each on 20 kB specs (the smoke test)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    runs, size = (1, 20_000) if args.quick else (args.runs, args.size)
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(f"specs/muon{ext}", ROOT / "specs" / f"muon{ext}") for ext in (".yaml", ".geom")]
        for name, make in (("generated.yaml", yaml_spec), ("generated.geom", dsl_spec)):
            path = Path(tmp) / name
            path.write_text(make(size), encoding="utf-8")
            cases.append((name, path))
        rows = []
        for name, path in cases:
            times, proc = [], None
            for _ in range(runs):
                t, proc = lint_once(path)
                times.append(t)
            if proc.returncode not in (0, 1):  # 2: the spec did not load
                print(proc.stdout + proc.stderr, file=sys.stderr)
                return 1
            text = path.read_text(encoding="utf-8")
            rules = text.count("\n  - name: ") + text.count("\nrule ")
            rows.append(f"| {name} | {path.stat().st_size / 1000:.1f} kB | {rules} | {statistics.median(times):.3f} | "
                        f"{min(times):.3f} | {'yes' if imports_torch(path) else 'no'} | {count(proc)} |")
    cpu = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    try:
        torch = f"torch {importlib.metadata.version('torch')} installed"
    except importlib.metadata.PackageNotFoundError:
        torch = "no torch installed"
    lines = [f"### geomopt lint (no model), {cpu}, Python {platform.python_version()}, {torch} — "
             f"{datetime.date.today().isoformat()}",
             "", f"| spec | size | rules | wall (s, median of {runs}) | wall (s, min) | imports torch | errors / warnings / notes |",
             "|---|---|---|---|---|---|---|", *rows]
    emit("\n".join(lines), args.record, "Lint speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
