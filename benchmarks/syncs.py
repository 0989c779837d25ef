"""Host synchronizations per step, for every shipped spec: what stands between a step and capture
in one CUDA graph (or ``torch.compile(fullgraph=True)``).

    python benchmarks/syncs.py [--record NOTE]

A step runs under a dispatch mode that counts the ops which read a device value back to the
host: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``), ``aten.is_nonzero``,
and the copies of a tensor to the CPU from another device. On CPU every tensor already lives on
the host, so the count is what the same step would wait for on an accelerator. The step is the
second of a tiny GPT (the first creates state), on finite gradients.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.models import GPT, GPTConfig  # noqa: E402

#: aten ops that hand a device value to the host
SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")


class SyncCounter(TorchDispatchMode):
    """Counts the host synchronizations of what runs under it, by op name."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def step_syncs(spec: str) -> Counter:
    """The host synchronizations of ``spec``'s second step on a tiny GPT."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = geomopt.GeomOptimizer(model, spec)
    idx = torch.randint(0, 32, (4, 8))
    for k in range(2):
        model.zero_grad(set_to_none=True)
        model(idx, idx)[1].backward()
        if k == 0:
            opt.step()
    with SyncCounter() as counter:
        opt.step()
    return counter.counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    lines = [f"### Host synchronizations per step (tiny GPT, CPU), torch {torch.__version__} — "
             f"{datetime.date.today().isoformat()}", "", "| spec | syncs per step | of which |", "|---|---|---|"]
    for name in sorted(geomopt.shipped_specs()):
        counts = step_syncs(name)
        detail = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in sorted(counts.items())) or "–"
        lines.append(f"| {name} | {sum(counts.values())} | {detail} |")
    emit("\n".join(lines), args.record, "Host synchronizations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
