"""Post-stages' cost: NorMuon, AdaMuon and cautious variants against the Muon spec they extend, on
the same tensors.

    python benchmarks/stages.py [--widths 384 768] [--iters 20] [--record NOTE]

Every parameter of an HF GPT-2 (2 layers, built from a config: random init, nothing downloaded)
gets a fixed random gradient; each optimizer steps its own copy, round-robin (the machine's drift
hits every row alike), medians after 3 warm-up steps. Each variant is ``specs/muon.yaml`` with
its hidden rule changed: NorMuon adds ``post: [second_moment(axis=row), rms_match(target=input)]``,
AdaMuon ``post: [second_moment(axis=element, bias_correction), rms_match(target=polar)]`` with
AdaMuon's momentum (α = 0.1, no Nesterov), "cautious" adds ``post: [cautious]`` and "cautious
decay" ``decay: cautious``. The figure is each variant's step time over the Muon spec's.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, ratio_table, round_robin  # noqa: E402
from elementwise import gpt2_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def variants() -> list[tuple[str, dict]]:
    """(name, spec dict): the Muon spec and its staged variants."""
    import yaml

    muon = yaml.safe_load((ROOT / "specs" / "muon.yaml").read_text())

    def hidden_with(name: str, **changes) -> dict:
        spec = copy.deepcopy(muon)
        spec["name"] = name
        rule = next(r for r in spec["rules"] if r["name"] == "hidden")
        rule.update(changes)
        return spec

    return [
        ("muon", muon),
        ("normuon", hidden_with("normuon", post=[{"kind": "second_moment", "axis": "row"},
                                                 {"kind": "rms_match", "target": "input"}])),
        ("adamuon", hidden_with("adamuon", direction={"kind": "polyak", "alpha": 0.1},
                                post=[{"kind": "second_moment", "axis": "element", "bias_correction": True},
                                      {"kind": "rms_match", "target": "polar"}])),
        ("muon + cautious", hidden_with("muon-cautious", post=[{"kind": "cautious"}])),
        ("muon + cautious decay", hidden_with("muon-cwd", decay={"kind": "cautious"})),
    ]


def measure(width: int, iters: int) -> tuple[list[tuple[str, float]], int]:
    import geomopt

    base, grads = gpt2_tensors(width)

    def fresh():
        params = [(n, torch.nn.Parameter(p.clone())) for n, p in base]
        for (_, p), g in zip(params, grads):
            p.grad = g.clone()
        return params

    rows = [(name, geomopt.GeomOptimizer(fresh(), spec).step) for name, spec in variants()]
    return round_robin(rows, iters), sum(p.numel() for _, p in base)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[384, 768])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--record", metavar="NOTE", help="record the tables in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from geomopt.cli.bench import device_name

    tables = []
    for width in args.widths:
        rows, n = measure(width, args.iters)
        heading = (f"### Post-stages: HF GPT-2 (2 layers, width {width}, {n / 1e6:.1f}M parameters), "
                   f"{device_name('cpu')}, float32, torch {torch.__version__} — {datetime.date.today().isoformat()}")
        tables.append(ratio_table(heading, "spec", "muon spec", rows))
    emit("\n\n".join(tables), args.record, "Update stages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
