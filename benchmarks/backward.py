"""Exact spectral backward steps: geomopt's batched op against per-matrix torch.linalg.svd.

    python benchmarks/backward.py [--device cpu|cuda] [--threads N] [--repeats N] [--record NOTE]

For each (constraint, Y) a bucket of B matrices is stepped (1) by geomopt's batched backward op
(Gram–eigh where it is as accurate as the SVD, see ``spectral_apply``) and (2) matrix by matrix:
torch.linalg.svd, the same scalar step on σ, U·Diag(x)·Vᵀ. Reports both times, the speed-up, and
both max-entry errors against the same step done by a float64 SVD of the same (float32) Y. Y is
either a Gaussian matrix (σ near the sets, as in training) or one whose σ spread over four
decades around the radius ("far").

The last three columns are the floor of any exact step that diagonalizes the small Gram matrix:
the time of the batched ``torch.linalg.eigh`` of G = YᵀY (YYᵀ when wide) alone, in float32, the
speed-up over the per-matrix SVD that such a step could reach if everything else were free, and
geomopt's time in units of that floor. The floor is timed in alternation with geomopt's op on
each row (``--repeats`` pairs, medians; the ratio is the median of the pairs' ratios), so load
that drifts during a run moves both alike.
"""

from __future__ import annotations

import argparse
import importlib
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

from pydantic import TypeAdapter  # noqa: E402

from geomopt.cli.bench import Timer, device_name  # noqa: E402
from geomopt.compile.fragments import ResolvedGeometry  # noqa: E402
from geomopt.geometry.prox import backward  # noqa: E402
from geomopt.spec.constraints import Constraint  # noqa: E402
from geomopt.spec.geometries import Geometry  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: the operators take the spec's typed models (validated as a plan holds them)
GEOMETRY = ResolvedGeometry(TypeAdapter(Geometry).validate_python(
    {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3}, "approx": {"kind": "svd"},
     "radius": 1.0}), None)
CASES = [(name, TypeAdapter(Constraint).validate_python(c)) for name, c in [
    ("frobenius_ball", {"kind": "frobenius_ball", "radius": 2.0}),
    ("rank", {"kind": "rank", "k": 16}),
    ("spectral_sphere", {"kind": "spectral_sphere", "radius": 0.5}),
    ("spectral_ball", {"kind": "spectral_ball", "radius": 0.5}),
]]


def _sigma_step(c, t, dtype):
    """The scalar step on σ that the op applies (the same private helpers)."""
    from geomopt.geometry.reference import make_reference

    scalar = importlib.import_module("geomopt.geometry.prox.scalar")
    vector = importlib.import_module("geomopt.geometry.prox.vector")

    ref = make_reference(GEOMETRY.reference)
    if c.kind == "frobenius_ball":
        return lambda s: scalar.ball_magnitudes(s, t, c.radius, ref, dtype)[0]
    return lambda s: vector.sigma_proj(c.kind, s, c)


def _per_matrix_svd(y, c, t):
    step = _sigma_step(c, t, y.dtype)
    out = []
    for yi in y:
        u, s, vh = torch.linalg.svd(yi, full_matrices=False)
        out.append((u * step(s[None])[0]) @ vh)
    return torch.stack(out)


def _paired(fa, fb, repeats: int, timer) -> tuple[float, float, float]:
    """Medians of fa's and fb's times, called in alternation, and the median of their ratios."""
    pairs = [(timer(fa, 0, 1)[0], timer(fb, 0, 1)[0]) for _ in range(repeats)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def _ms(v: float) -> str:
    """Milliseconds to 0.1 ms, and to three digits below 1 ms (tiny shapes)."""
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--shape", default="256x128")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--record", metavar="NOTE")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    m, n = (int(s) for s in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.batch, m, n, generator=gen, dtype=torch.float64) / (m ** 0.5)
    u, _, vh = torch.linalg.svd(base, full_matrices=False)
    far = (u * torch.logspace(1, -3, min(m, n), dtype=torch.float64)) @ vh  # σ from 10 to 1e-3
    gamma = 0.05
    t = gamma * GEOMETRY.radius
    rows = []
    timer = Timer(args.device)
    for label, y64 in (("", base), (", far", far)):
        y = y64.float().to(args.device)
        gram = y.mT @ y if m >= n else y @ y.mT
        eigh = lambda: torch.linalg.eigh(gram)  # the eigensolver alone
        for name, c in CASES:
            batched = lambda: backward(y, gamma, GEOMETRY, c, batch_dims=1)[0]
            single = lambda: _per_matrix_svd(y, c, t)
            timer(batched, 1, 0), timer(eigh, 1, 0)
            tb, floor, ratio = _paired(batched, eigh, args.repeats, timer)
            ts = statistics.median(timer(single, 1, 5))
            exact = _per_matrix_svd(y.double(), c, t)
            err_b = (batched().double() - exact).abs().max().item()
            err_s = (single().double() - exact).abs().max().item()
            rows.append((name + label, ts, tb, ts / tb, err_s, err_b, floor, ts / floor, ratio))
    dev = device_name(args.device)
    lines = [f"### backward steps, {args.batch} × {m}×{n} fp32 on {dev} — {datetime.date.today()}, torch {torch.__version__}",
             "", "| constraint, Y | per-matrix SVD (ms) | geomopt batched (ms) | speed-up | SVD error | geomopt error "
             "| eigh(G) alone (ms) | eigh-bound speed-up | geomopt / eigh floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {_ms(r[1])} | {_ms(r[2])} | {r[3]:.1f}× | {r[4]:.1e} | {r[5]:.1e} | {_ms(r[6])} | {r[7]:.1f}× | {r[8]:.2f} |"
              for r in rows]
    emit("\n".join(lines), args.record, section_for(args.device, "Backward steps"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
