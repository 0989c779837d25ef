"""Exact spectral backward steps: one batched call against per-matrix torch.linalg.svd.

    python benchmarks/backward.py [--device cpu|cuda] [--record NOTE]

For each (constraint, shape) a bucket of B matrices Y = X − t·U (X feasible, U a random direction)
is stepped (1) by geomopt's batched backward op and (2) matrix by matrix: torch.linalg.svd, the
same scalar step on σ, U·Diag(x)·Vᵀ. Reports both times, the speed-up and the max difference.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

from geomopt.geometry.backward import backward

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY = {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
            "approx": {"kind": "svd"}, "radius": 1.0, "split": None}
CASES = [
    ("frobenius_ball", {"kind": "frobenius_ball", "radius": 2.0}),
    ("rank", {"kind": "rank", "k": 16}),
    ("spectral_sphere", {"kind": "spectral_sphere", "radius": 0.5}),
    ("spectral_ball", {"kind": "spectral_ball", "radius": 0.5}),
]


def _time(fn, device, iters=5):
    fn()
    out = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--shape", default="256x128")
    p.add_argument("--record", metavar="NOTE")
    args = p.parse_args(argv)
    m, n = (int(s) for s in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(args.batch, m, n, generator=gen) / (m ** 0.5)).to(args.device)
    gamma = 0.05
    rows = []
    for name, c in CASES:
        batched = lambda: backward(y, gamma, GEOMETRY, c, batch_dims=1)[0]
        single = lambda: torch.stack([backward(yi, gamma, GEOMETRY, c)[0] for yi in y])
        tb, ts = _time(batched, args.device), _time(single, args.device)
        diff = (batched() - single()).abs().max().item()
        rows.append((name, ts, tb, ts / tb, diff))
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"### backward steps, {args.batch} × {m}×{n} fp32 on {dev} — {datetime.date.today()}, torch {torch.__version__}",
             "", "| constraint | per-matrix SVD loop (ms) | batched (ms) | speed-up | max |Δ| |", "|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f}× | {r[4]:.1e} |" for r in rows]
    emit("\n".join(lines), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
