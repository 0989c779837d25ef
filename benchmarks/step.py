"""Optimizer step time against torch.optim.Muon and fused AdamW on the same tensors.

    python benchmarks/step.py [--model gpt-bench] [--device cpu|cuda] [--spec specs/muon.yaml …]
    python benchmarks/step.py --spec specs/catalog/muon.yaml --dion 0.25 0.0625   # Dion's ranks

``--dion R …`` adds specs/catalog/dion.yaml once per rank R (a fraction of min(m, n), or an int),
named ``dion-r<R>``, to the specs timed on the same tensors.

A thin wrapper over ``geomopt bench`` that also records the table in benchmarks/RESULTS.md
(``--record NOTE``: in place of the same configuration's record).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

from geomopt.cli.bench import bench, device_name, hidden_matrices, table

ROOT = Path(__file__).resolve().parents[1]


def dion_at(rank: float):
    """specs/catalog/dion.yaml with its hidden rule's rank set to ``rank`` (an int where it is ≥ 1)."""
    import geomopt

    data = geomopt.load_spec(ROOT / "specs" / "catalog" / "dion.yaml").model_dump()
    r = int(rank) if rank >= 1 else rank
    data["name"] = f"dion-r{r}"
    for rule in data["rules"]:
        if (rule.get("direction") or {}).get("kind") == "dion":
            rule["direction"]["rank"] = r
    return geomopt.Spec.model_validate(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--spec", action="append")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dion", nargs="+", type=float, metavar="RANK", default=[],
                   help="also time specs/catalog/dion.yaml at these ranks (fractions of min(m, n), or ints ≥ 1)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    specs: list = args.spec or [str(ROOT / "specs" / "muon.yaml")]
    specs += [dion_at(rank) for rank in args.dion]
    rows = bench(args.model, specs, device=args.device, iters=args.iters)
    base = hidden_matrices(args.model, "meta", torch.float32)
    n = sum(math.prod(t.shape) for _, t in base)
    where = (f"Dion vs Muon, {args.model} ({device_name(args.device)})" if args.dion else
             f"{args.model} on {device_name(args.device)}")  # a heading of its own: docs quote each kind
    header = (f"### {where} — {datetime.date.today().isoformat()}, torch "
              f"{torch.__version__}, {len(base)} hidden matrices ({n / 1e6:.1f}M parameters)")
    section = "Dion" if args.dion else section_for(args.device, "Optimizer step on CPU")
    emit(table(rows, header), args.record, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
