"""Grokking on modular division (the paper's Appendix "Modular arithmetic", DivMod97).

Task: x / y mod 97 = x·y⁻¹ mod 97 for every pair (x, y), y ≠ 0 (97·96 = 9312 examples), a random
train fraction (default 0.5), the rest for validation. Model: a small modern transformer built
here after github.com/atveit/torch_grokking (token embedding, RoPE attention, RMSNorm, SiLU MLP,
pre-norm, untied output layer `head`), reading the sequence [x, ∘, y, =] and predicting from the
last position. Default size: 2 layers, width 64, 4 heads, batch 512. torch_grokking uses width 128,
which costs about 3× the CPU time per epoch; width 64 is what fits several seeds with a 500-epoch
cap into ~30 min on one CPU thread, and on seed 0 its validation curves over the first 75 epochs
are close to width 128's (`--width 128` restores it). An epoch is one pass over the training set
(⌈4656 / 512⌉ = 10 steps). Optimizers (the paper's Figure "grokking"):

  AdamW            torch.optim.AdamW(lr 1e-3, betas (0.9, 0.98), weight decay 1.0) — torch_grokking's setting
  uScion           specs/examples/grokking-uscion.yaml (ρ_l = 1 on hidden matrices, ρ_L = 10 on the head)
  uScion + clip    specs/examples/grokking-spectral-clip.yaml (+ spectral-ball clipping of the hidden
                   matrices at the lmo radius; no constraint on the embedding)

Metric: epochs to 95% validation accuracy (capped at --max-epochs, 500 as in the paper; a run
that never gets there counts as the cap), median over seeds. Validation accuracy is measured after
every epoch and a run stops at the first epoch that reaches the target (--full-curves trains on to
the cap). All optimizers use a linear warmup of --warmup epochs, then a constant learning rate.

Run:  python examples/grokking.py              # defaults: 5 seeds, cap 500, one CPU thread (27 min here)
      python examples/grokking.py --seeds 10   # the paper's 10 seeds
      python examples/grokking.py --quick      # 1 seed, 3 epochs, width 32: a smoke test (seconds)
      python examples/grokking.py --record     # rewrite the committed examples/results/grokking.*
Writes grokking.json (exact command, settings, the machine, per-seed epochs, curves and times,
medians, wall time; rewritten after every run, so an interrupted run keeps what it finished) and
grokking.png to --out (default runs/grokking/ under the current directory). The docs' times
are per epoch: each seed's mean, min–max over the seeds (every epoch is the same work).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from geomopt.cli.demo import save_figure  # noqa: E402
from geomopt.cli.threads import add_threads_arg, choose_threads, training_step  # noqa: E402

import geomopt  # noqa: E402

P = 97


# ---------------------------------------------------------------- data


def divmod_data(p: int = P, train_fraction: float = 0.5, seed: int = 0):
    """All (x, y), y ≠ 0, as token sequences [x, op, y, eq] with target x·y^(p−2) mod p."""
    x, y = torch.meshgrid(torch.arange(p), torch.arange(1, p), indexing="ij")
    x, y = x.reshape(-1), y.reshape(-1)
    target = torch.tensor([(int(a) * pow(int(b), p - 2, p)) % p for a, b in zip(x, y)])
    op, eq = p, p + 1
    seqs = torch.stack([x, torch.full_like(x, op), y, torch.full_like(x, eq)], dim=1)
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed))
    n_train = int(train_fraction * len(seqs))
    tr, va = perm[:n_train], perm[n_train:]
    return (seqs[tr], target[tr]), (seqs[va], target[va])


# ---------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, base: float = 10000.0):
    """Rotary position embedding on (b, h, t, dh)."""
    t, dh = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, dh, 2, dtype=torch.float32, device=x.device) / dh)
    ang = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, heads)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.down(F.silu(self.up(self.norm2(x)))))


class GrokNet(nn.Module):
    def __init__(self, p: int = P, d: int = 128, depth: int = 2, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(p + 2, d)
        self.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(depth))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, p, bias=False)

    def forward(self, seq):
        x = self.embed(seq)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, -1]))


# ---------------------------------------------------------------- training


def make_optimizer(name: str, model, args):
    if name == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.98), weight_decay=args.adamw_wd)
    opt = geomopt.GeomOptimizer(model, _common.spec_path(OPTIMIZERS[name]))
    if args.scion_lr:
        for g in opt.param_groups:
            g["lr"] = args.scion_lr
            g["initial_lr"] = args.scion_lr
    return opt


OPTIMIZERS = {"AdamW": None, "uScion": "grokking-uscion", "uScion + spectral clip": "grokking-spectral-clip"}


def probe_step(name: str, args):
    """One training step of a throwaway model with ``name``'s optimizer on a first batch: what the
    thread probe times (torch's global random state left as it was)."""
    with torch.random.fork_rng(devices=[]):
        (xtr, ytr), _ = divmod_data(P, args.train_fraction, 0)
        model = GrokNet(P, args.width, args.depth, args.heads, args.dropout)
        opt = make_optimizer(name, model, args)
    x, y = xtr[: args.batch], ytr[: args.batch]
    return training_step(model, opt, lambda m: F.cross_entropy(m(x), y))


def run_one(name: str, seed: int, args) -> dict:
    torch.manual_seed(seed)
    (xtr, ytr), (xva, yva) = divmod_data(P, args.train_fraction, seed)
    model = GrokNet(P, args.width, args.depth, args.heads, args.dropout)
    opt = make_optimizer(name, model, args)
    steps_per_epoch = math.ceil(len(xtr) / args.batch)
    warm = max(1, args.warmup * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm))
    gen = torch.Generator().manual_seed(seed + 1)
    curve = []
    hit = None
    start = time.perf_counter()
    for epoch in range(1, args.max_epochs + 1):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        correct = 0
        for i in range(0, len(xtr), args.batch):
            idx = perm[i : i + args.batch]
            logits = model(xtr[idx])
            loss = F.cross_entropy(logits, ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            correct += (logits.argmax(-1) == ytr[idx]).sum().item()
        model.eval()
        with torch.no_grad():
            val_acc = (model(xva).argmax(-1) == yva).float().mean().item()
        curve.append((epoch, correct / len(xtr), val_acc))
        if hit is None and val_acc >= args.target:
            hit = epoch
            if not args.full_curves:
                break
    seconds = time.perf_counter() - start
    return dict(optimizer=name, seed=seed, epochs_to_target=hit if hit is not None else args.max_epochs,
                reached=hit is not None, final_train_acc=curve[-1][1], final_val_acc=curve[-1][2],
                seconds=round(seconds, 2), curve=curve)


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per optimizer: epochs to the target per seed (the cap where not reached), their median, how many reached it."""
    summary = {}
    for name in names:
        rs = [r for r in runs if r["optimizer"] == name]
        eps = [r["epochs_to_target"] for r in rs]
        summary[name] = dict(spec=OPTIMIZERS[name] and _common.spec_label(OPTIMIZERS[name]), seeds=[r["seed"] for r in rs],
                             epochs=eps, median_epochs=_common.median(eps), reached=sum(r["reached"] for r in rs),
                             runs=len(rs), seconds=round(sum(r["seconds"] for r in rs), 1))
    return summary


def plot(runs: list[dict], summary: dict, path: Path, args) -> bool:
    plt = _common.pyplot()
    if plt is None:
        return False
    names = list(summary)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.0))
    colors = dict(zip(names, ["C0", "C1", "C2"]))
    for r in runs:
        ep = [c[0] for c in r["curve"]]
        ax0.plot(ep, [c[2] for c in r["curve"]], color=colors[r["optimizer"]], alpha=0.8,
                 label=r["optimizer"] if r["seed"] == args.seed0 else None)
        ax0.plot(ep, [c[1] for c in r["curve"]], ":", color=colors[r["optimizer"]], alpha=0.4)
    ax0.axhline(args.target, color="k", lw=0.5)
    ax0.set_xlabel("epoch")
    ax0.set_ylabel("accuracy (solid: validation, dotted: train)")
    ax0.set_title(f"x/y mod {P}, train fraction {args.train_fraction}")
    ax0.legend()
    ax0.grid(alpha=0.3)
    for i, n in enumerate(names):
        ys = summary[n]["epochs"]
        ax1.scatter([i] * len(ys), ys, color=colors[n], alpha=0.6)
        ax1.hlines(summary[n]["median_epochs"], i - 0.3, i + 0.3, color=colors[n], lw=3)
    ax1.axhline(args.max_epochs, color="k", ls="--", lw=0.8, label=f"cap ({args.max_epochs})")
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel(f"epochs to {args.target:.0%} val. accuracy (bar: median)")
    ax1.set_title(f"{len(args.seed_list)} seed(s)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="number of seeds (paper: 10; default 5 to fit ~25 min on one CPU thread)")
    ap.add_argument("--seed0", type=int, default=0, help="first seed")
    ap.add_argument("--max-epochs", type=int, default=500, help="cap on epochs (paper: 500); a run that never reaches --target counts as the cap")
    ap.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    ap.add_argument("--train-fraction", type=float, default=0.5)
    ap.add_argument("--width", type=int, default=64, help="model width (torch_grokking: 128)")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=10, help="linear warmup, in epochs")
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--adamw-wd", type=float, default=1.0)
    ap.add_argument("--scion-lr", type=float, default=0.0, help="override the specs' lr (default: the spec's)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of: " + ", ".join(OPTIMIZERS))
    ap.add_argument("--full-curves", action="store_true", help="keep training to --max-epochs after hitting the target")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 3-epoch cap, width 32, 1 warmup epoch unless given")
    add_threads_arg(ap)
    _common.add_output_args(ap, "grokking")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:  # new defaults; flags given explicitly still win
        ap.set_defaults(seeds=1, max_epochs=3, width=32, warmup=1)
        args = ap.parse_args(argv)
    out = _common.resolve_output(ap, args, "grokking")
    args.seed_list = list(range(args.seed0, args.seed0 + args.seeds))
    names = _common.chosen_optimizers(ap, args.optimizers, OPTIMIZERS)
    threads = choose_threads(args.threads, lambda: probe_step(names[0], args))
    print(threads.header(), flush=True)
    t0 = time.perf_counter()
    settings = _common.settings_of(args, p=P, examples=P * (P - 1), optimizers=names)
    runs = []
    # seeds outermost, so that an interrupted run has every optimizer on the same seeds so far
    for seed in args.seed_list:
        for name in names:
            r = run_one(name, seed, args)
            runs.append(r)
            print(f"{name:<24} seed {seed}: {'reached' if r['reached'] else 'NOT reached'} {args.target:.0%} val. acc. "
                  f"at epoch {r['epochs_to_target']} (val {r['final_val_acc']:.3f}, train {r['final_train_acc']:.3f}, "
                  f"{r['seconds']:.1f} s; {time.perf_counter() - t0:.0f} s so far)", flush=True)
            summary = summarize(runs, names)
            _common.write_results(out / "grokking.json", settings=settings, seconds=time.perf_counter() - t0, threads=threads,
                                  results=dict(summary=summary, runs=runs, complete=len(runs) == len(names) * len(args.seed_list)))
    total = time.perf_counter() - t0
    print(f"\n| optimizer | spec | median epochs to {args.target:.0%} (cap {args.max_epochs}) | per seed | reached | time (s) |")
    print("|---|---|---|---|---|---|")
    for n, s in summary.items():
        print(f"| {n} | {s['spec'] or 'torch.optim.AdamW'} | {s['median_epochs']:g} | {s['epochs']} | {s['reached']}/{s['runs']} | {s['seconds']} |")
    print(f"total {total:.1f} s")
    _common.write_results(out / "grokking.json", settings=settings, results=dict(summary=summary, runs=runs, complete=True),
                          seconds=total, threads=threads)
    if plot(runs, summary, out / "grokking.png", args):
        print(f"wrote {out / 'grokking.json'} and {out / 'grokking.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
