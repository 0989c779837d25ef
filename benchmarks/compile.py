"""Compile time of a 10,000-tensor model and of a Llama-3-8B-sized one, three workloads:

* ``names``: a 20-rule spec of name patterns against an iterable of (name, tensor) with meta
  tensors (no memory, no init) and realistic dotted names (``blocks.{i}.attn.q.weight`` …);
* ``roles``: the shipped ``muon.yaml`` (rules by role, ``view: auto``) against an ``nn.Module`` of
  the same tensors built on the meta device, with a forward and example inputs, so deciding roles
  (one traced forward on meta, and the module tree's inference) is timed too;
* ``llama-8b``: ``muon.yaml`` against Hugging Face's ``LlamaForCausalLM`` with Llama-3-8B's config
  (32 layers, width 4096, 128,256 tokens) built on the meta device: its forward traced on meta.

Reports the median of 5 runs of ``compile_spec`` for each, the trace cache cleared before each
run; with ``--record`` each row replaces the same workload's under "## Compile" in
benchmarks/RESULTS.md.

    python benchmarks/compile.py [--blocks 500] [--runs 5] [--record] [--note TEXT]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from geomopt.compile import compile_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record_row, workload_key  # noqa: E402

D = 64  # small widths: compile time depends on names and rules, not on tensor size

# 20 tensors per block: 500 blocks = 10,000 tensors.
BLOCK = {
    "ln_1.weight": (D,), "ln_1.bias": (D,),
    "attn.q.weight": (D, D), "attn.q.bias": (D,),
    "attn.k.weight": (D, D), "attn.k.bias": (D,),
    "attn.v.weight": (D, D), "attn.v.bias": (D,),
    "attn.o.weight": (D, D), "attn.o.bias": (D,),
    "ln_2.weight": (D,), "ln_2.bias": (D,),
    "mlp.fc.weight": (4 * D, D), "mlp.fc.bias": (4 * D,),
    "mlp.gate.weight": (4 * D, D), "mlp.gate.bias": (4 * D,),
    "mlp.proj.weight": (D, 4 * D), "mlp.proj.bias": (D,),
    "adapter.down.weight": (D // 4, D), "adapter.up.weight": (D, D // 4),
}


def synthetic_params(blocks: int) -> list[tuple[str, torch.Tensor]]:
    out = [(f"blocks.{i}.{suffix}", torch.empty(shape, device="meta")) for i in range(blocks)
           for suffix, shape in BLOCK.items()]
    return [(n, torch.nn.Parameter(t)) for n, t in out]


class Block(torch.nn.Module):
    """The tensors of :data:`BLOCK` as modules (attention, MLP, adapter, norms)."""

    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.attn = torch.nn.Module()
        for n in "qkvo":
            setattr(self.attn, n, lin(D, D))
        self.mlp = torch.nn.Module()
        self.mlp.fc, self.mlp.gate, self.mlp.proj = lin(D, 4 * D), lin(D, 4 * D), lin(4 * D, D)
        self.adapter = torch.nn.Module()
        self.adapter.down, self.adapter.up = lin(D, D // 4, bias=False), lin(D // 4, D, bias=False)


    def forward(self, x):
        h = self.ln_1(x)
        q, k, v = self.attn.q(h), self.attn.k(h), self.attn.v(h)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        x = x + self.attn.o(att)
        h = self.ln_2(x)
        x = x + self.mlp.proj(torch.nn.functional.gelu(self.mlp.fc(h)) * self.mlp.gate(h))
        return x + self.adapter.up(self.adapter.down(x))


class Model(torch.nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.emb = torch.nn.Embedding(256, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(D, 256, bias=False)

    def example_inputs(self):
        return torch.zeros(1, 4, dtype=torch.long, device=self.head.weight.device)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def llama_8b() -> torch.nn.Module:
    """Hugging Face Llama with Llama-3-8B's configuration, on the meta device (no memory)."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def synthetic_model(blocks: int) -> torch.nn.Module:
    with torch.device("meta"):
        return Model(blocks)


def _spectral(**extra) -> dict:
    return {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz", "steps": 5},
            "scale": "scion", **extra}


ISO = {"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}, "scale": "scion"}
SIGN = {"kind": "anisotropic", "reference": {"kind": "indicator"}, "scale": "scion"}

SPEC = {
    "geomopt": 1,
    "name": "bench-20-rules",
    "defaults": {"lr": 0.02, "direction": {"kind": "polyak", "alpha": 0.1}},
    "rules": [
        {"name": "first-block-q", "match": "blocks.0.attn.q.weight", "geometry": _spectral()},
        {"name": "first-block", "match": {"name": "blocks.0.**", "ndim": 2}, "geometry": _spectral(), "lr": 0.01},
        {"name": "last-block", "match": {"name": "blocks.499.**", "ndim": 2}, "geometry": _spectral(), "lr": 0.01},
        {"name": "queries", "match": "blocks.*.attn.q.weight", "geometry": _spectral(),
         "constraint": {"kind": "spectral_ball", "radius": 1.0, "relative": True}},
        {"name": "keys", "match": "blocks.*.attn.k.weight", "geometry": _spectral(),
         "constraint": {"kind": "frobenius_ball", "radius": 0.5, "relative": True}},
        {"name": "values", "match": "re:blocks\\.\\d+\\.attn\\.v\\.weight", "geometry": _spectral()},
        {"name": "out", "match": {"name": "blocks.*.attn.o.weight", "shape": [D, "*"]}, "geometry": _spectral()},
        {"name": "fc", "match": "blocks.*.mlp.fc.weight", "geometry": _spectral(), "weight_decay": 0.1},
        {"name": "gate", "match": "**.gate.weight", "geometry": _spectral()},
        {"name": "proj", "match": {"name": "**.proj.weight", "ndim": [2, 3]}, "geometry": _spectral()},
        {"name": "adapter-down", "match": "blocks.?.adapter.down.weight", "geometry": SIGN},
        {"name": "adapter", "match": "re:blocks\\.\\d+\\.adapter\\.(down|up)\\.weight",
         "geometry": {"kind": "rowwise", "reference": {"kind": "log_barrier", "eps": 1e-8}, "scale": "scion"}},
        {"name": "unused-conv", "match": {"name": "**.conv.weight", "ndim": 4}, "geometry": _spectral()},
        {"name": "qkv-bias", "match": "re:.*\\.attn\\.[qkv]\\.bias", "geometry": ISO, "lr": 0.01},
        {"name": "o-bias", "match": "**.attn.o.bias", "geometry": ISO},
        {"name": "mlp-bias", "match": "blocks.*.mlp.*.bias", "geometry": ISO},
        {"name": "norm-weights", "match": {"name": "**.ln_?.weight", "ndim": 1}, "geometry": ISO},
        {"name": "norm-biases", "match": "**.ln_*.bias", "geometry": ISO},
        {"name": "matrices", "match": {"name": "**", "ndim": 2}, "geometry": SIGN},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam", "betas": [0.9, 0.95]}},
    ],
}


MUON = Path(__file__).resolve().parents[1] / "specs" / "muon.yaml"


def bench(blocks: int, runs: int, workload: str = "names") -> tuple[float, float, int]:
    """(median wall seconds, median process CPU seconds, tensors planned) over ``runs`` compiles.

    CPU time is reported too: on a shared 2-core machine the wall time also measures the neighbours."""
    import importlib

    from geomopt.compile import as_spec

    try:
        trace_cache = importlib.import_module("geomopt.compile.trace.forward")._CACHE
    except ImportError:  # a package from before roles were traced (a --before run)
        trace_cache = {}

    if workload == "names":
        spec, model = SPEC, synthetic_params(blocks)
    elif workload == "roles":
        spec, model = as_spec(MUON), synthetic_model(blocks)
    else:
        spec, model = as_spec(MUON), llama_8b()
    compile_spec(spec, model)  # warm-up: imports, regex cache
    wall, cpu, n = [], [], 0
    for _ in range(runs):
        trace_cache.clear()  # each run traces
        t0, c0 = time.perf_counter(), time.process_time()
        plan = compile_spec(spec, model)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        n = len(plan)
    return statistics.median(wall), statistics.median(cpu), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=500)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="record the rows in benchmarks/RESULTS.md")
    ap.add_argument("--note", default="", help="free text for the last column")
    ap.add_argument("--workloads", nargs="+", default=["names", "roles", "llama-8b"],
                    choices=["names", "roles", "llama-8b"])
    args = ap.parse_args()
    print(f"| date | machine | torch | workload | wall (median of {args.runs}) | CPU | note |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        wall, cpu, n = bench(args.blocks, args.runs, workload)
        load = f"load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        note = "; ".join(x for x in (args.note, load) if x)
        how = "traced" if importlib.util.find_spec("geomopt.compile.trace.forward") else "from the module tree"
        what = {"names": f"{len(SPEC['rules'])} name rules × {n} tensors",
                "roles": f"muon.yaml (roles {how}, view: auto) × {n}-tensor nn.Module",
                "llama-8b": f"muon.yaml × Llama-3-8B config on meta ({n} tensors, roles {how})"}[workload]
        row = (f"| {datetime.date.today().isoformat()} | {os.cpu_count()}-core CPU ({platform.machine()}) "
               f"| torch {torch.__version__} | {what} | {wall * 1000:.0f} ms | {cpu * 1000:.0f} ms | {note} |")
        print(row)
        if args.record:
            record(row, args.runs)


def record(row: str, runs: int) -> None:
    """The row in place of the same workload's on this machine, under "## Compile" in RESULTS.md."""
    intro = [f"`python benchmarks/compile.py`: `compile_spec` of a 20-rule spec against 10,000 meta tensors "
             f"(iterable of (name, tensor)), of muon.yaml (roles decided, by a traced forward where there is "
             f"one) against the same tensors as an nn.Module, and of muon.yaml against a Llama-3-8B config on "
             f"meta; median of {runs} runs.", "",
             "Targets: names < 0.5 s; with the trace, the 10,000-tensor model < 1 s and Llama-3-8B < 5 s. CPU "
             "is the process time (robust to other load on the machine).", "",
             "| date | machine | torch | workload | wall | CPU | note |", "|---|---|---|---|---|---|---|"]
    record_row("Compile", intro, row, workload_key)


if __name__ == "__main__":
    main()
