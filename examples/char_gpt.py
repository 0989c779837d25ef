"""Proximal spectral preconditioning with a Frobenius-ball constraint on a byte-level GPT (the
paper's Appendix "NanoGPT" experiment, scaled down to text that ships with Python).

Model and data: geomopt.models.GPT (nanoGPT-style, GPT-2 parameter names; default 2 layers,
4 heads, width 64, context 64) on pydoc's bundled topic help (the corpus of `geomopt demo`,
90/10 train/validation split), byte level. The training loop, corpus and plot are
geomopt.cli.demo's ``train``, ``corpus_bytes`` and ``plot``. Optimizers, each a spec in specs/examples/ (or specs/):

  uScion                  uscion.yaml                      unconstrained Scion (the paper's baseline)
  prox Frobenius 0.5ρ     prox-muon-frobenius.yaml         + proximal Frobenius ball at half the lmo radius,
                                                           Polar Express forward (the paper's setting)
  prox Frobenius 4ρ       char-gpt-prox-frobenius-r4.yaml  the same with a ball 8× larger (see below)

All with the same lr (the specs' 0.02), linear warmup then linear decay to 10%.

Run:  python examples/char_gpt.py                              # defaults: about 3 min on 2 CPU cores
      python examples/char_gpt.py --device cuda --steps 5000 --n-layer 6 --n-embd 384 --block 256 --batch 64
      python examples/char_gpt.py --record                     # rewrite the committed examples/results/char_gpt.*
Writes char_gpt.json and char_gpt.png to --out (default runs/char_gpt/ under the current directory).
--repeats N (3 with --record) trains each optimizer N times, interleaved, and records every run's
time (the docs show their min–max); losses and norms are the first run's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import corpus_bytes, plot, probe_step, span, train  # noqa: E402
from geomopt.cli.threads import add_threads_arg, choose_threads  # noqa: E402
from geomopt.models import GPTConfig  # noqa: E402

OPTIMIZERS = {
    "uScion": "uscion",
    "prox Frobenius 0.5ρ": "prox-muon-frobenius",
    "prox Frobenius 4ρ": "char-gpt-prox-frobenius-r4",
}


def hidden_norms(model, opt) -> dict:
    """‖W‖_F / ρ and ‖W‖₂ / ρ of each hidden weight at the end (ρ: its lmo radius), the largest
    over the matrices of its view (a fused q, k, v weight is three matrices, each with its ρ)."""
    out = {}
    plan = {pp.name: pp for pp in opt.plan}
    for name, p in model.named_parameters():
        pp = plan.get(name)
        if pp is None or pp.rule != "hidden":
            continue
        w = p.detach().float()
        w = (w.T if pp.transpose else w).reshape(pp.op_shape[0], -1)
        view = pp.geometry.get("view") or {}
        sizes = view.get("blocks") or [w.shape[0]]
        factors = view.get("factors") or [1.0] * len(sizes)
        blocks = [(m, pp.radius * f) for m, f in zip(w.split(sizes), factors)]
        out[name] = dict(fro_over_rho=round(max(m.norm().item() / r for m, r in blocks), 3),
                         spec_over_rho=round(max(torch.linalg.matrix_norm(m, 2).item() / r for m, r in blocks), 3))
    return out


def build_parser(name: str = "char_gpt", optimizers: dict = OPTIMIZERS, seeds: int = 1,
                 doc: str = __doc__) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=seeds)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=0, help="linear warmup steps (0: none; linear decay to 10%%)")
    ap.add_argument("--lr", type=float, default=0.0, help="override the specs' lr (default: the spec's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--optimizers", default=",".join(optimizers), help="comma-separated subset of: " + ", ".join(optimizers))
    ap.add_argument("--quick", action="store_true", help="20 steps, width 32 (for tests)")
    ap.add_argument("--no-progress", action="store_true")
    add_threads_arg(ap)
    _common.add_output_args(ap, name, repeats=True)
    return ap


def main(argv=None, key: str = "char_gpt", optimizers: dict = OPTIMIZERS, seeds: int = 1, doc: str = __doc__) -> int:
    """The training of each of ``optimizers`` (label → spec) at each seed, written as ``key``.json
    and .png (examples/learned_metric.py runs it with its own optimizers)."""
    ap = build_parser(key, optimizers, seeds, doc)
    args = ap.parse_args(argv)
    out = _common.resolve_output(ap, args, key)
    if args.quick:
        args.steps, args.n_embd, args.block = 20, 32, 32
    names = _common.chosen_optimizers(ap, args.optimizers, optimizers)
    config = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    first = _common.spec_path(optimizers[names[0]])
    threads = choose_threads(args.threads, lambda: probe_step(lambda m: geomopt.GeomOptimizer(m, first), config=config,
                                                              batch=args.batch, device=args.device), args.device)
    print(threads.header(), flush=True)
    eval_every = max(1, args.steps // 20)
    t0 = time.perf_counter()
    runs = []
    for seed in range(args.seed0, args.seed0 + args.seeds):
        kept = {}  # optimizer → its first run at this seed
        for k in range(args.repeats):  # interleaved, so that a change in the machine's load reaches every optimizer
            for name in names:
                held = {}

                def make_opt(model, _spec=_common.spec_path(optimizers[name])):
                    opt = geomopt.GeomOptimizer(model, _spec)
                    if args.lr:
                        for g in opt.param_groups:
                            g["lr"] = g["initial_lr"] = args.lr
                    held.update(model=model, opt=opt)
                    return opt

                label = name if args.repeats == 1 else f"{name} ({k + 1}/{args.repeats})"
                r = train(make_opt, steps=args.steps, seed=seed, batch=args.batch, eval_every=eval_every, label=label,
                          progress=not args.no_progress, warmup=args.warmup, config=config, device=args.device)
                if k:  # a timing repeat: keep its time, check it trained the same
                    f = kept[name]
                    f["seconds_runs"].append(round(r["seconds"], 2))
                    f["identical"] = f["identical"] and r["train"] == f["train"] and r["val"] == f["val"]
                    print(f"seed {seed} {name:<22} run {k + 1}/{args.repeats}: {r['seconds']:.1f} s", flush=True)
                    continue
                r.update(label=name, optimizer=name, seed=seed, spec=_common.spec_label(optimizers[name]),
                         final_val=r["val"][-1], best_val=min(r["val"]), norms=hidden_norms(held["model"], held["opt"]),
                         fallbacks={rule: v.get("fallbacks") for rule, v in held["opt"].diagnostics().items()
                                    if isinstance(v, dict)},
                         seconds_runs=[round(r["seconds"], 2)], identical=True)
                kept[name] = r
                runs.append(r)
                fro = [v["fro_over_rho"] for v in r["norms"].values()]
                norms = f"hidden ‖W‖_F/ρ {min(fro):.2f}–{max(fro):.2f}, " if fro else ""  # (a spec without a hidden rule)
                print(f"seed {seed} {name:<22} val {r['final_val']:.4f} (best {r['best_val']:.4f}), "
                      f"{norms}{r['seconds']:.1f} s", flush=True)
    for r in runs:
        r["seconds"] = round(_common.median(r["seconds_runs"]), 2)
    summary = {}
    for n in names:
        rs = [r for r in runs if r["optimizer"] == n]
        m, s = _common.mean_std([r["final_val"] for r in rs])
        summary[n] = dict(spec=rs[0]["spec"], final_val=[r["final_val"] for r in rs], mean_final_val=m, std_final_val=s,
                          bits_per_byte=m / math.log(2), seconds=round(sum(r["seconds"] for r in rs), 1),
                          seconds_per_run=[t for r in rs for t in r["seconds_runs"]])
    total = time.perf_counter() - t0
    print(f"\n| optimizer | spec | final val. loss (nats/byte) | bits/byte | time per run (s) |")
    print("|---|---|---|---|---|")
    for n, s in summary.items():
        pm = f" ± {s['std_final_val']:.4f}" if len(s["final_val"]) > 1 else ""
        print(f"| {n} | {s['spec']} | {s['mean_final_val']:.4f}{pm} | {s['bits_per_byte']:.3f} | "
              f"{span(s['seconds_per_run'], '{:.1f}')} |")
    print(f"total {total:.1f} s")
    if not all(r["identical"] for r in runs):
        print("note: the repeated runs' losses differ (nondeterministic kernels); the table shows the first runs'")
    settings = _common.settings_of(args, optimizers=names, corpus_bytes=len(corpus_bytes()), eval_every=eval_every)
    _common.write_results(out / f"{key}.json", settings=settings, results=dict(summary=summary, runs=runs), seconds=total,
                          threads=threads,
                          device=args.device, extra=dict(repeats_identical=all(r["identical"] for r in runs)))
    first = [r for r in runs if r["seed"] == args.seed0]
    if plot(first, out / f"{key}.png"):
        print(f"wrote {out / f'{key}.json'} and {out / f'{key}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
