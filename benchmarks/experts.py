"""One Newton–Schulz step over MoE experts: an (E, out, in) expert weight read as E matrices
(``view: {kind: matrix, batch: 1}``) against E separate (out, in) tensors, which the optimizer
stacks into one bucket — same spec, same gradients, same process, alternating.

    python benchmarks/experts.py [--experts 8] [--shape 256x128] [--tensors 4] [--iters 10]
                                 [--device cpu|cuda] [--record NOTE]

``--tensors`` expert weights of each form (e.g. the gate_up and down weights of several layers).
The view costs a reshape (no copy): the target is ratio ≤ 1.0 up to noise. Newton–Schulz runs in
float32 (bf16 matmuls are slow on CPUs without native bf16).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name  # noqa: E402


def spec(view: dict | None) -> dict:
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, "scale": "muon_original",
                "approx": {"kind": "newton_schulz", "steps": 5, "dtype": "float32"},
                "prenormalize": {"kind": "max", "eps": 1e-7}}
    if view is not None:
        geometry["view"] = view
    return {"geomopt": 1, "name": "experts", "defaults": {"lr": 0.02, "weight_decay": 0.1},
            "rules": [{"name": "experts", "match": "**", "geometry": geometry,
                       "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True}}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shape", default="256x128")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = ap.parse_args(argv)
    out, inp = (int(s) for s in args.shape.split("x"))
    e, n, dev = args.experts, args.tensors, torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(e, out, inp, generator=gen) for _ in range(n)]
    grads = [torch.randn(e, out, inp, generator=gen) for _ in range(n)]

    def batched():
        ps = [(f"layers.{i}.experts.w", torch.nn.Parameter(w.clone().to(dev))) for i, w in enumerate(weights)]
        for (_, p), g in zip(ps, grads):
            p.grad = g.to(dev)
        return ps, geomopt.GeomOptimizer(ps, spec({"kind": "matrix", "batch": 1}))

    def separate():
        ps = [(f"layers.{i}.experts.{j}.w", torch.nn.Parameter(w[j].clone().to(dev)))
              for i, w in enumerate(weights) for j in range(e)]
        for (name, p), g in zip(ps, (g[j] for g in grads for j in range(e))):
            p.grad = g.to(dev)
        return ps, geomopt.GeomOptimizer(ps, spec(None))

    cases = {"batched": batched(), "separate": separate()}
    timer = Timer(args.device)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.iters):  # alternate, so both see the same machine load
        for k, (_, opt) in cases.items():
            times[k] += timer(opt.step, warmup=1 if not times[k] else 0, iters=1)
    # the same update, up to rounding: each expert is its own matrix in both
    (pb, _), (ps, _) = cases["batched"], cases["separate"]
    diff = max(float((pb[i][1].detach()[j] - ps[i * e + j][1].detach()).abs().max()) for i in range(n) for j in range(e))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [f"### MoE experts, Newton–Schulz fp32, {n} × ({e}, {out}, {inp}) on {device_name(args.device)} — "
            f"{datetime.date.today().isoformat()}, torch {torch.__version__}", "",
            "| form | step ms (median) | ratio to separate | max abs diff of the weights |", "|---|---|---|---|",
            f"| {n} tensors ({e}, {out}, {inp}), view batch: 1 | {med['batched']:.1f} | "
            f"{med['batched'] / med['separate']:.2f}× | {diff:.1e} |",
            f"| {n * e} tensors ({out}, {inp}), one bucket | {med['separate']:.1f} | 1.00× | - |"]
    emit("\n".join(rows), args.record, section_for(args.device, "MoE experts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
