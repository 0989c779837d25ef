"""Muon on a mixture-of-experts model: a shipped spec routes any architecture by role.

Model: a small Mixtral (transformers' MixtralForCausalLM from a config, random init; default 2
layers, width 64, 4 heads (2 key/value heads), 4 experts of width 128, top-2 routing, vocabulary
= the 256 byte values, context 64). Its expert weights are batched tensors, (experts, out, in):
``gate_up_proj`` (4, 256, 64) holds every expert's gate and up projections, ``down_proj``
(4, 64, 128) their down projections; ``mlp.gate`` is the router (4, 64).

``specs/muon.yaml`` names no parameter: its rules match roles (embedding, head, router, hidden,
expert), which geomopt infers from the model's structure, and its spectral rule reads the matrix
``view: auto``, so each expert's matrix is orthogonalized on its own (gate_up_proj: each expert's
gate and up halves, 8 matrices of 128×64), the router and the head get AdamW. The routing table
(one layer, plus the embedding, final norm and head) is printed and saved in the results JSON.

Data and training: the byte-level corpus of `geomopt demo` (pydoc's bundled topic help, 90/10
train/validation split), the same seed, initial weights and batches for both optimizers, batch 32,
linear decay to 10% of the lr; the training loss adds Mixtral's load-balancing loss
(router_aux_loss_coef 0.001), the reported validation loss is the cross-entropy alone
(nats/byte, 4 fixed batches of 64). Optimizers:

  muon.yaml   specs/muon.yaml (lr 0.02 on hidden and expert matrices, AdamW lr 1e-3 elsewhere)
  AdamW       torch.optim.AdamW(lr 3e-3, betas (0.9, 0.95), weight decay 0.1) — as `geomopt demo`

Newton–Schulz dtype: muon.yaml leaves it at ``auto``, bf16 on CUDA (as torch.optim.Muon) and
float32 on CPU, where bf16 matmuls are emulated on CPUs without native bf16 (AVX2-only, like this
project's); the spec is used exactly as shipped.

Run:  python examples/moe.py                 # defaults: 400 steps per optimizer, about 2–3 min on one CPU thread
      python examples/moe.py --quick         # 8 steps: a smoke test (seconds)
      python examples/moe.py --record        # rewrite the committed examples/results/moe.* (3 timed runs each)
Writes moe.json and moe.png to --out (default runs/moe/ under the current directory). --repeats N
(3 with --record) trains each optimizer N times, interleaved, and records every run's time (the
docs show their min–max); losses are the first run's. The docs' tables are generated from
examples/results/moe.json by scripts/readme_tables.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import corpus_bytes, plot, probe_step, span, train  # noqa: E402
from geomopt.cli.threads import add_threads_arg, choose_threads  # noqa: E402
from geomopt.compile.plan import view_text  # noqa: E402
from geomopt.geometry.dtypes import compute_dtype  # noqa: E402

SPEC = "muon"
OPTIMIZERS = ("muon.yaml", "AdamW")


def build_model(args):
    import transformers  # an examples dependency

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.expert_width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2), num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=args.block, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.001)
    return transformers.MixtralForCausalLM(config)


def routing_rows(plan, layer: int = 0) -> list[dict]:
    """One row per tensor of layer ``layer`` and of no layer (embedding, final norm, head)."""
    rows = []
    for p in plan:
        if ".layers." in p.name and f".layers.{layer}." not in p.name:
            continue
        rows.append(dict(parameter=p.name, shape="×".join(map(str, p.shape)), role=p.role, rule=p.rule,
                         geometry=p.geometry["kind"], view=view_text(p), lr=p.lr))
    return rows


def moe_loss(model, x, y):
    """(cross-entropy + Mixtral's load-balancing loss, the cross-entropy alone)."""
    out = model(input_ids=x)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), y.reshape(-1))
    return ce + model.config.router_aux_loss_coef * out.aux_loss, ce


def train_one(label: str, make_opt, args, *, progress: bool) -> dict:
    """Train one fresh model (seed ``args.seed``) with ``make_opt(model)`` through demo.train's
    loop (its data, batches, schedule and curves)."""
    result = train(make_opt, steps=args.steps, seed=args.seed, block=args.block, batch=args.batch,
                   eval_every=max(1, args.steps // 20), label=label, progress=progress, device=args.device,
                   build=lambda: build_model(args), loss=moe_loss)
    result["seconds"] = round(result["seconds"], 2)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="training steps per optimizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=64, help="context length (bytes)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    add_threads_arg(ap)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of: " + ", ".join(OPTIMIZERS))
    ap.add_argument("--quick", action="store_true", help="8 steps (for tests)")
    ap.add_argument("--no-progress", action="store_true")
    _common.add_output_args(ap, "moe", repeats=True)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    out = _common.resolve_output(ap, args, "moe")
    if args.quick:
        args.steps = 8
    names = _common.chosen_optimizers(ap, args.optimizers, OPTIMIZERS)
    spec = _common.spec_path(SPEC)
    threads = choose_threads(args.threads, lambda: probe_step(lambda m: geomopt.GeomOptimizer(m, spec), block=args.block,
                                                              batch=args.batch, build=lambda: build_model(args),
                                                              loss=moe_loss, device=args.device), args.device)
    print(threads.header(), flush=True)
    dtype = str(compute_dtype(torch.empty(0, device=args.device), "newton_schulz")).removeprefix("torch.")  # auto here
    note = f"Newton–Schulz in {dtype} (muon.yaml's dtype auto on {args.device})"
    print(note)

    makers = {
        "muon.yaml": lambda m: geomopt.GeomOptimizer(m, spec),
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1),
    }
    describe = {
        "muon.yaml": f"`specs/muon.yaml` (Newton–Schulz in {dtype})",
        "AdamW": f"AdamW (lr {args.adamw_lr:g}, betas (0.9, 0.95), wd 0.1)",
    }
    routing = routing_rows(geomopt.GeomOptimizer(build_model(args), spec).plan)
    print("\n== routing of specs/muon.yaml on Mixtral (layer 0 and the tensors outside the layers)")
    cols = ("parameter", "shape", "role", "rule", "geometry", "view")
    width = {k: max(len(k), *(len(str(r[k])) for r in routing)) for k in cols}
    print("  ".join(k.ljust(w) for k, w in width.items()))
    for r in routing:
        print("  ".join(str(r[k]).ljust(w) for k, w in width.items()).rstrip())

    t0 = time.perf_counter()
    runs = {}
    print(f"\n== training {args.steps} steps per optimizer (seed {args.seed})"
          + (f", {args.repeats} timed runs each" if args.repeats > 1 else ""))
    for k in range(args.repeats):  # interleaved, so that a change in the machine's load reaches every optimizer
        for name in names:
            label = name if args.repeats == 1 else f"{name} ({k + 1}/{args.repeats})"
            r = train_one(label, makers[name], args, progress=not args.no_progress)
            if k:  # a timing repeat: keep its time, check it trained the same
                f = runs[name]
                f["seconds_runs"].append(r["seconds"])
                f["identical"] = f["identical"] and r["train"] == f["train"] and r["val"] == f["val"]
                print(f"{name:<10} run {k + 1}/{args.repeats}: {r['seconds']:.1f} s", flush=True)
                continue
            r.update(label=name, optimizer=name, final_val=r["val"][-1], best_val=min(r["val"]),
                     seconds_runs=[r["seconds"]], identical=True)
            runs[name] = r
            print(f"{name:<10} val {r['final_val']:.4f} (best {r['best_val']:.4f}), {r['seconds']:.1f} s", flush=True)
    runs = list(runs.values())
    for r in runs:
        r["seconds"] = round(_common.median(r["seconds_runs"]), 2)
    total = time.perf_counter() - t0
    summary = {r["optimizer"]: dict(describe=describe[r["optimizer"]], final_val=r["final_val"], best_val=r["best_val"],
                                    bits_per_byte=r["final_val"] / math.log(2), seconds=r["seconds"],
                                    seconds_runs=r["seconds_runs"]) for r in runs}

    settings = _common.settings_of(
        args, optimizers=names, ns_dtype_used=dtype, cpu_capability=torch.backends.cpu.get_cpu_capability(),
        corpus_bytes=len(corpus_bytes()), eval_every=max(1, args.steps // 20), model="MixtralForCausalLM",
        transformers=__import__("transformers").__version__)
    _common.write_results(out / "moe.json", settings=settings, results=dict(summary=summary, runs=runs),
                          seconds=total, device=args.device, threads=threads,
                          extra=dict(note=note, routing=routing, repeats_identical=all(r["identical"] for r in runs)))
    print("\n| optimizer | final val. loss (nats/byte) | best val. loss | bits/byte | time per run (s) |")
    print("|---|---|---|---|---|")
    for s in summary.values():
        print(f"| {s['describe']} | {s['final_val']:.3f} | {s['best_val']:.3f} | {s['bits_per_byte']:.2f} | "
              f"{span(s['seconds_runs'], '{:.1f}')} |")
    if not all(r["identical"] for r in runs):
        print("note: the repeated runs' losses differ (nondeterministic kernels); the table shows the first runs'")
    print(f"total {total:.1f} s")
    if plot(runs, out / "moe.png", "byte-level Mixtral (4 experts, top-2) on Python's bundled docs"):
        print(f"wrote {out / 'moe.json'} and {out / 'moe.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
