"""newton_schulz against gram_newton_schulz (the same map iterated on the small Gram side, restarted:
geomopt/geometry/spectral.py): time per call on batches of wide matrices, the FLOPs each does, and
each one's error against float64 newton_schulz.

    python benchmarks/gram_ns.py [--shapes 256x1024 512x2048 256x4096] [--batch 4] [--steps 5]
                                 [--restarts 2] [--iters 7] [--threads 1] [--record NOTE]

Timings alternate between the two (one call each, ``--iters`` times, after one warm-up call each)
and the table gives medians.
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

from geomopt.cli.bench import device_name  # noqa: E402
from geomopt.geometry.spectral import gram_newton_schulz, newton_schulz  # noqa: E402


def flops(m: int, n: int, steps: int, restarts: list[int]) -> tuple[int, int]:
    """Matmul FLOPs (2·m·n·k per product) per matrix, m ≤ n: newton_schulz's steps, each A = XXᵀ,
    A², (bA + cA²)·X; gram_newton_schulz's Gram matrices and rectangular products (once, at each
    restart, at the end) and its m×m products (P = bA + cA², R ← Q·R after a step's first,
    A ← Q·A·Q where another step follows without a restart)."""
    m, n = min(m, n), max(m, n)
    ns = steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)
    rs = sorted({r for r in restarts if 1 <= r < steps})
    rect = (1 + 2 * len(rs) + 1) * 2 * m * m * n  # Gram at the start and at each restart, X at each restart and the end
    small, fresh = 0, True
    for i in range(1, steps + 1):
        small += 2 * m ** 3 + (0 if fresh else 2 * m ** 3)
        fresh = i in rs
        if i < steps and i not in rs:
            small += 4 * m ** 3
    return ns, rect + small


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    num = (got.double() - want).norm(dim=(-2, -1))
    return (num / want.norm(dim=(-2, -1))).max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["256x1024", "512x2048", "256x4096"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--restarts", type=int, nargs="*", default=[2])
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    restarts = [r for r in args.restarts if r < args.steps]
    fns = {"newton_schulz": lambda x: newton_schulz(x, steps=args.steps),
           "gram_newton_schulz": lambda x: gram_newton_schulz(x, steps=args.steps, restarts=restarts)}
    lines = [f"### newton_schulz vs gram_newton_schulz: {args.batch} matrices, float32, {args.steps} steps, "
             f"restarts {restarts}, {device_name('cpu')}, torch {torch.__version__} — {datetime.date.today().isoformat()}",
             "",
             "| shape | newton_schulz (ms) | gram_newton_schulz (ms) | speed-up | FLOPs ratio | NS error | Gram NS error |",
             "|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        m, n = map(int, shape.lower().split("x"))
        x = torch.randn(args.batch, m, n, generator=torch.Generator().manual_seed(args.seed))
        times = {name: [] for name in fns}
        outs = {name: fn(x) for name, fn in fns.items()}  # the warm-up call, kept for the errors
        for _ in range(args.iters):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
        exact = newton_schulz(x.double(), steps=args.steps)
        ns_ms, gram_ms = (statistics.median(times[name]) for name in fns)
        ns_flops, gram_flops = flops(m, n, args.steps, restarts)
        lines.append(f"| {args.batch} × {m}×{n} | {ns_ms:.1f} | {gram_ms:.1f} | {ns_ms / gram_ms:.2f}× | "
                     f"{ns_flops / gram_flops:.2f}× | {rel_err(outs['newton_schulz'], exact):.1e} | "
                     f"{rel_err(outs['gram_newton_schulz'], exact):.1e} |")
    lines += ["", f"Median of {args.iters} alternating calls each; errors: largest relative Frobenius error over the "
              "batch against float64 newton_schulz on the same input."]
    emit("\n".join(lines), args.record, "Gram Newton–Schulz")
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(code)
