"""Step time and held state of the kronecker geometry (Shampoo, SOAP, PSGD-Kron) beside
pytorch-optimizer's Shampoo, ScalableShampoo and SOAP, and beside Muon (geomopt's and
torch.optim.Muon), on the same matrices and gradients, in one process.

    python benchmarks/kron.py [--width 256] [--layers 2] [--every 10] [--units 6] [--record NOTE]

The matrices are a GPT-2 block's (c_attn 3w×w, c_proj w×w, c_fc 4w×w, mlp.c_proj w×4w) per layer.
A timed unit is ``every`` consecutive steps, so each unit holds one refresh of the roots or bases
(the eigendecompositions amortized over their interval); the optimizers take their units in turn
(round robin: the machine's drift hits every row alike), and a row's figure is the median unit's
time over ``every``: ms per step, refresh included. Held state: the bytes of every tensor the
optimizer keeps after the run (a list entry's tensors counted one by one). heavyball's KLShampoo,
SOAP and PSGDKron have rows where heavyball is installed (run eagerly). pytorch-optimizer's Kron
has no row: without the opt_einsum package its einsums form the outer product of a matrix's two
factors (m²·n² entries: 275 GB for a 1024 × 256 matrix).
"""

from __future__ import annotations

import argparse
import datetime
import warnings
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import device_name  # noqa: E402


def shapes(width: int, layers: int) -> list[tuple[int, int]]:
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def state_bytes(state) -> int | None:
    """Bytes of the tensors an optimizer keeps (list entries' tensors one by one, nested dicts
    walked: heavyball keeps a dict per parameter); None where it keeps objects of its own, whose
    tensors this does not see (ScalableShampoo's preconditioners)."""

    def held(v) -> int | None:
        if torch.is_tensor(v):
            return v.numel() * v.element_size()
        if isinstance(v, (list, tuple, dict)):
            parts = [held(x) for x in (v.values() if isinstance(v, dict) else v)]
            return None if None in parts else sum(p for p in parts if p is not None)
        if isinstance(v, (set, frozenset)):  # heavyball's flags (which entries are initialized)
            return 0 if all(isinstance(x, (int, str)) for x in v) else None
        return 0 if v is None or isinstance(v, (int, float, bool, str)) else None

    return held(list(state.values()))


def _spec(geometry: dict, direction: dict | None = None) -> dict:
    rule = {"name": "all", "match": "**", "geometry": geometry}
    if direction is not None:
        rule["direction"] = direction
    return {"geomopt": 1, "name": "bench", "rules": [rule]}


MUON = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}
NESTEROV = {"kind": "polyak", "alpha": 0.05, "nesterov": True}  # torch.optim.Muon's momentum 0.95


def _heavyball_rows(params_of, every: int) -> list[tuple[str, object]]:
    """heavyball's Kronecker-factored optimizers, run eagerly (``heavyball.utils.compile_mode =
    None``: by default each step is compiled by inductor, minutes on a CPU); none where heavyball
    is not installed. KLShampoo is its Shampoo: KL-corrected factors, the preconditioner from the
    eigenvalues diag(Qᵀ·F·Q) in a basis refreshed every ``every`` steps."""
    try:
        import heavyball
        import heavyball.utils
    except ImportError:
        print("heavyball is not installed: its rows are left out", file=sys.stderr)
        return []
    heavyball.utils.compile_mode = None
    return [
        (f"heavyball.KLShampoo (every {every})",
         heavyball.KLShampoo(params_of(), lr=0.003, precondition_frequency=every, weight_decay=0.0)),
        (f"heavyball.SOAP (every {every})",
         heavyball.SOAP(params_of(), lr=0.003, precondition_frequency=every, weight_decay=0.0)),
        ("heavyball.PSGDKron (fit every step)",
         heavyball.PSGDKron(params_of(), lr=0.003, preconditioner_update_probability=1.0)),
    ]


def optimizers(params_of, every: int) -> list[tuple[str, object]]:
    """(name, optimizer) rows, each on its own copy of the parameters (``params_of()``)."""
    import pytorch_optimizer as po

    def shampoo(root: str) -> dict:
        return {"kind": "kronecker", "method": "shampoo", "every": every, "root": root}

    return [
        ("torch.optim.Muon", torch.optim.Muon(params_of(), lr=0.02, momentum=0.95, nesterov=True)),
        ("geomopt muon", geomopt.GeomOptimizer(params_of(), _spec(MUON, NESTEROV), lr=0.02)),
        (f"geomopt kronecker shampoo, root: eigh (every {every})",
         geomopt.GeomOptimizer(params_of(), _spec(shampoo("eigh")), lr=0.02)),
        (f"geomopt kronecker shampoo, root: newton (every {every})",
         geomopt.GeomOptimizer(params_of(), _spec(shampoo("newton")), lr=0.02)),
        (f"pytorch_optimizer.Shampoo, float32 SVD (every {every})",
         po.Shampoo(params_of(), lr=0.02, preconditioning_compute_steps=every)),
        (f"pytorch_optimizer.ScalableShampoo, coupled Newton (every {every})",
         po.ScalableShampoo(params_of(), lr=0.02, preconditioning_compute_steps=every, start_preconditioning_step=1,
                            block_size=4096, shape_interpretation=False)),
        (f"geomopt kronecker soap (every {every})",
         geomopt.GeomOptimizer(params_of(), _spec({"kind": "kronecker", "method": "soap", "every": every}), lr=0.003)),
        (f"pytorch_optimizer.SOAP (every {every})", po.SOAP(params_of(), lr=0.003, precondition_frequency=every)),
        ("geomopt kronecker psgd (fit every step)",
         geomopt.GeomOptimizer(params_of(), _spec({"kind": "kronecker", "method": "psgd", "every": 1}), lr=0.003)),
        *_heavyball_rows(params_of, every),
    ]


def measure(width: int, layers: int, every: int, units: int) -> tuple[list[tuple[str, float, int | None]], int]:
    torch.manual_seed(0)
    init = [torch.randn(s) * s[1] ** -0.5 for s in shapes(width, layers)]
    copies: list[list[torch.Tensor]] = []

    def params_of():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        copies.append(ps)
        return ps

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unnamed tensors: one rule takes them all
        rows = optimizers(params_of, every)
    grads = [[torch.randn_like(t) for t in init] for _ in range(every)]

    def unit(opt, ps):
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi
            opt.step()

    unit_times: dict = {name: [] for name, _ in rows}
    for _ in range(1):  # warm-up: the first steps allocate the state and compute the first roots
        for (name, opt), ps in zip(rows, copies):
            unit(opt, ps)
    for _ in range(units):
        for (name, opt), ps in zip(rows, copies):
            t0 = time.perf_counter()
            unit(opt, ps)
            unit_times[name].append((time.perf_counter() - t0) * 1e3 / every)
    out = [(name, statistics.median(unit_times[name]), state_bytes(opt.state)) for name, opt in rows]
    return out, sum(t.numel() for t in init)


def table(heading: str, rows: list[tuple[str, float, int | None]], params: int) -> str:
    base_ms = rows[0][1]
    lines = [heading, "", "| optimizer | ms per step (refresh amortized) | × torch.optim.Muon | state (MB) | "
             "state bytes per parameter |", "|---|---|---|---|---|"]
    for name, ms, b in rows:
        held = "not counted (objects of its own)" if b is None else f"{b / 1e6:.2f} | {b / params:.1f}"
        lines.append(f"| {name} | {ms:.2f} | {ms / base_ms:.3f} | {held} |".replace("own) |", "own) | — |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="the roots' and bases' refresh interval")
    p.add_argument("--units", type=int, default=6, help="timed units of `every` steps per optimizer")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    rows, n = measure(args.width, args.layers, args.every, args.units)
    heading = (f"### Kronecker geometries: {args.layers} GPT-2 blocks' matrices (width {args.width}, "
               f"{n / 1e6:.2f}M parameters), {device_name('cpu')}, float32, torch {torch.__version__} — "
               f"{datetime.date.today().isoformat()}")
    emit(table(heading, rows, n), args.record, "Kronecker geometries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
