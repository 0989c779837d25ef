"""SVD-free constrained steps against the exact ones and the unconstrained step.

    python benchmarks/svd_free.py [--model gpt-bench] [--spec specs/stiefel.yaml …] [--device cpu|cuda]
                                  [--record NOTE]

For each spec, three optimizers step on copies of the model's hidden matrices (fixed random
gradients), round-robin: the spec with its spectral constraint removed, with ``method: exact``
(batched Gram–eigh, or the SVD where that is not as accurate) and with ``method: polar`` (matrix
iterations only). Reports medians and the ratio
to the unconstrained step (target of the performance issue: polar ≤ 2×).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name, hidden_matrices  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SVD_FREE = ("stiefel", "spectral_ball")


def variant(spec: dict, method):
    out = copy.deepcopy(spec)
    for rule in out["rules"]:
        c = rule.get("constraint")
        if c and c["kind"] in SVD_FREE:
            if method is None:
                rule["constraint"] = None
            else:
                c["method"] = method
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--spec", action="append")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--record", metavar="NOTE")
    args = p.parse_args(argv)
    specs = args.spec or [str(ROOT / "specs" / "stiefel.yaml"), str(ROOT / "specs" / "spectral-clip.yaml")]
    base = hidden_matrices(args.model, args.device, torch.float32)
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(t.shape, generator=gen) * 1e-3).to(args.device) for _, t in base]
    timer = Timer(args.device)
    lines = [f"### SVD-free steps, {args.model} on {device_name(args.device)} — {datetime.date.today().isoformat()}, torch "
             f"{torch.__version__}", "", "| spec | constraint | step (ms) | × unconstrained |", "|---|---|---|---|"]
    for path in specs:
        spec = geomopt.load_spec(path).model_dump()
        opts = {}
        for label, method in (("none", None), ("exact", "exact"), ("polar", "polar")):
            params = [(n, torch.nn.Parameter(t.detach().clone())) for n, t in base]
            for (_, q), g in zip(params, grads):
                q.grad = g.clone()
            opts[label] = geomopt.GeomOptimizer(params, variant(spec, method))
        times: dict = {k: [] for k in opts}
        for _ in range(2):
            for opt in opts.values():
                opt.step()
        for _ in range(args.iters):  # round-robin
            for k, opt in opts.items():
                times[k] += timer(opt.step, 0, 1)
        base_ms = statistics.median(times["none"])
        for k, v in times.items():
            ms = statistics.median(v)
            lines.append(f"| {Path(path).stem} | {k} | {ms:.1f} | {ms / base_ms:.2f} |")
    emit("\n".join(lines), args.record, section_for(args.device, "SVD-free constrained steps"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
