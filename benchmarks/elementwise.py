"""Elementwise specs against torch's fused AdamW on the same tensors: the adam geometry, sign
descent and normalized SGD (all memory-bound, so fused AdamW, one pass over x, g, m, v, is the
floor to compare with).

    python benchmarks/elementwise.py [--widths 384 768] [--iters 40] [--base COMMIT] [--record NOTE]

Every parameter of an HF GPT-2 (2 layers, built from a config: random init, nothing downloaded)
gets a fixed random gradient; each optimizer steps its own copy, round-robin (the machine's drift
hits every row alike), medians after 3 warm-up steps. Rows: ``AdamW(fused=True)``, torch's
``SGD(momentum, foreach)`` (the same memory traffic as a momentum sign or normalized step: what
torch would spend), geomopt's specs, and ``check`` (geomopt's finiteness test of the gradients
alone: the pass geomopt adds to every step so a non-finite gradient never reaches the state).
``… (on_nonfinite: off)``: the adam spec without that test (torch's behaviour).
``--base COMMIT`` adds the same specs run by that commit's package (:mod:`ab`'s import).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, ratio_table, round_robin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = ["examples/adam-all", "sign-descent", "normalized-sgd"]
VOCAB = {64: 512, 384: 8192, 768: 50257}
#: specs also run with ``on_nonfinite: off`` (the adam geometry: compared with fused AdamW, which does not test)
OFF = ["examples/adam-all"]


def off(path: str) -> dict:
    """The spec at ``path`` with ``defaults.on_nonfinite: off``."""
    import yaml

    with open(path, encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    spec.setdefault("defaults", {})["on_nonfinite"] = "off"
    return spec


def gpt2_tensors(width: int):
    """(name, tensor) of an HF GPT-2's parameters and one fixed random gradient per tensor."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=max(1, width // 64),
                                     vocab_size=VOCAB.get(width, 8192), n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    base = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for _, p in base]
    return base, grads


def measure(width: int, iters: int, base_pkg=None) -> tuple[list[tuple[str, float]], int]:
    import geomopt
    from geomopt.optim.engine.nonfinite import sum_finite as _sum_finite

    base, grads = gpt2_tensors(width)

    def fresh():
        params = [(n, torch.nn.Parameter(p.clone())) for n, p in base]
        for (_, p), g in zip(params, grads):
            p.grad = g.clone()
        return params

    def plain(ps):
        return [p for _, p in ps]

    check_grads = [g.clone() for g in grads]
    rows = [("AdamW (fused)", torch.optim.AdamW(plain(fresh()), lr=1e-3, weight_decay=0.1, fused=True).step),
            ("SGD (momentum, foreach)", torch.optim.SGD(plain(fresh()), lr=1e-3, momentum=0.9, foreach=True).step),
            ("check (geomopt's finiteness test alone)", lambda: bool(_sum_finite(check_grads)))]
    for spec in SPECS:
        path = str(ROOT / "specs" / f"{spec}.yaml")
        rows.append((f"geomopt {spec}", geomopt.GeomOptimizer(fresh(), path).step))
        if spec in OFF:  # the same spec under on_nonfinite: off (no finiteness test: torch's behaviour)
            rows.append((f"geomopt {spec} (on_nonfinite: off)", geomopt.GeomOptimizer(fresh(), off(path)).step))
        if base_pkg is not None:
            rows.append((f"base {spec}", base_pkg.GeomOptimizer(fresh(), path).step))
    return round_robin(rows, iters), sum(p.numel() for _, p in base)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[384, 768])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--base", help="git commit whose geomopt runs the same specs beside this tree's")
    p.add_argument("--record", metavar="NOTE", help="record the tables in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    from geomopt.cli.bench import device_name

    base_pkg = None
    if args.base:
        from ab import import_base

        base_pkg = import_base(args.base, Path(tempfile.mkdtemp()))
    tables = []
    for width in args.widths:
        rows, n = measure(width, args.iters, base_pkg)
        heading = (f"### Elementwise steps: HF GPT-2 (2 layers, width {width}, {n / 1e6:.1f}M parameters), "
                   f"{device_name('cpu')}, float32, torch {torch.__version__} — {datetime.date.today().isoformat()}"
                   + (f", base {args.base}" if args.base else ""))
        tables.append(ratio_table(heading, "optimizer", "fused AdamW", rows))
    emit("\n\n".join(tables), args.record, "Elementwise rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
