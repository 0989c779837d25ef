"""Muon's Newton–Schulz (5 steps of Muon's triple from D/max(‖D‖_F, ε), catalog/muon.yaml) against
Turbo-Muon's (4 steps of the ``aol`` set from the AOL rescaling, catalog/turbo-muon.yaml): time per
call on batches of wide matrices, and each one's distance to the polar factor UVᵀ.

    python benchmarks/turbo_ns.py [--shapes 256x1024 512x2048 1024x1024] [--batch 4] [--iters 7]
                                  [--threads 1] [--record NOTE]

Timings alternate between the two (one call each, ``--iters`` times, after one warm-up call each)
and the table gives medians. AOL reuses its Gram matrix for the first step, so Turbo-Muon does 4/5
of Muon's matrix products (4m²n + 2m³ per step and matrix, m ≤ n) plus O(m²) elementwise work.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, round_robin  # noqa: E402
from gram_ns import rel_err  # noqa: E402

from geomopt.cli.bench import device_name  # noqa: E402
from geomopt.geometry.spectral import newton_schulz  # noqa: E402
from geomopt.spec.geometries import Prenormalize  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

_PRENORM: TypeAdapter[Prenormalize] = TypeAdapter(Prenormalize)

#: name → (newton_schulz options): the hidden rules of catalog/muon.yaml and catalog/turbo-muon.yaml
ITERATIONS = {
    "muon": dict(steps=5, prenormalize=_PRENORM.validate_python({"kind": "max", "eps": 1e-7})),
    "turbo-muon": dict(steps=4, coefficients="aol", prenormalize=_PRENORM.validate_python({"kind": "aol", "eps": 1e-7})),
}


def polar_factor(x: torch.Tensor) -> torch.Tensor:
    """UVᵀ of each matrix, in float64."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["256x1024", "512x2048", "1024x1024"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fns = {name: (lambda x, kw=kw: newton_schulz(x, **kw)) for name, kw in ITERATIONS.items()}
    lines = [f"### Muon's Newton–Schulz vs Turbo-Muon's: {args.batch} Gaussian matrices, float32, "
             f"{device_name('cpu')}, torch {torch.__version__} — {datetime.date.today().isoformat()}",
             "",
             "| shape | muon, 5 steps (ms) | turbo-muon, 4 steps (ms) | speed-up | muon: ‖NS − UVᵀ‖/‖UVᵀ‖ | "
             "turbo-muon: ‖NS − UVᵀ‖/‖UVᵀ‖ |",
             "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        m, n = map(int, shape.lower().split("x"))
        x = torch.randn(args.batch, m, n, generator=torch.Generator().manual_seed(args.seed))
        outs = {name: fn(x) for name, fn in fns.items()}  # the warm-up call, kept for the errors
        timed = round_robin([(name, lambda fn=fn, x=x: fn(x)) for name, fn in fns.items()], args.iters, warmup=0)
        (_, muon_ms), (_, turbo_ms) = timed
        polar = polar_factor(x)
        lines.append(f"| {args.batch} × {m}×{n} | {muon_ms:.1f} | {turbo_ms:.1f} | {muon_ms / turbo_ms:.2f}× | "
                     f"{rel_err(outs['muon'], polar):.3f} | {rel_err(outs['turbo-muon'], polar):.3f} |")
    lines += ["", f"Median of {args.iters} alternating calls each; errors: largest over the batch."]
    emit("\n".join(lines), args.record, "Turbo-Muon's Newton–Schulz")
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(code)
