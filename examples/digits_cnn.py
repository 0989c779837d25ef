"""Weight constraints for a small CNN (the paper's Appendix "CIFAR10" experiment, on data that
ships with scikit-learn: the 8×8 handwritten digits, 1797 images, 10 classes).

Model: geomopt.models.SmallCNN (three 3×3 conv layers with BatchNorm, width 32/64/64, a linear
head). Optimizers, each a spec in specs/examples/ (or specs/):

  uScion                        digits-uscion.yaml              unconstrained Scion (ρ_l = 1, ρ_L = 10)
  + spectral clip               digits-spectral-clip.yaml       + projection onto the spectral ball at the lmo radius
  + Frobenius (Euclidean proj.) digits-frobenius-euclidean.yaml + Euclidean projection onto the Frobenius ball at the lmo
                                                                  radius (the paper's SVD-free heuristic)
  + Frobenius (anisotropic prox) digits-frobenius-prox.yaml     + the exact spectral prox onto that ball (Thm 3.5 + App. A.1)

Protocol: a stratified train/test split (default 75/25, fixed per seed), --epochs epochs of
mini-batch training with a linear warmup and linear decay to 0, test accuracy at the end; mean ±
std over seeds. The paper's CIFAR10 figure averages 50 runs at ρ_l = 8, ρ_L = 128 on a GPU.

Run:  python examples/digits_cnn.py                  # defaults: see --help (about 3 min on 2 CPU cores)
      python examples/digits_cnn.py --seeds 20 --epochs 30
      python examples/digits_cnn.py --record         # rewrite the committed examples/results/digits_cnn.*
Writes digits_cnn.json (with every run's time: the docs' time range is over seeds, each the same
work) and digits_cnn.png to --out (default runs/digits_cnn/ under the current directory).
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
from geomopt.cli.demo import save_figure  # noqa: E402
from geomopt.cli.threads import add_threads_arg, choose_threads, training_step  # noqa: E402

import geomopt  # noqa: E402
from geomopt.models import SmallCNN  # noqa: E402

OPTIMIZERS = {
    "uScion": "digits-uscion",
    "+ spectral clip": "digits-spectral-clip",
    "+ Frobenius (Euclidean proj.)": "digits-frobenius-euclidean",
    "+ Frobenius (anisotropic prox)": "digits-frobenius-prox",
}


def digits(seed: int, test_fraction: float):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target)
    itr, ite = train_test_split(range(len(y)), test_size=test_fraction, stratify=d.target, random_state=seed)
    return (x[itr], y[itr]), (x[ite], y[ite])


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    model.train()
    return acc


def probe_step(name: str, args):
    """One training step of a throwaway model with ``name``'s optimizer on a first batch: what the
    thread probe times (torch's global random state left as it was)."""
    with torch.random.fork_rng(devices=[]):
        (xtr, ytr), _ = digits(0, args.test_fraction)
        model = SmallCNN(in_channels=1, width=args.width, n_classes=10)
        opt = geomopt.GeomOptimizer(model, _common.spec_path(OPTIMIZERS[name]))
    x, y = xtr[: args.batch], ytr[: args.batch]
    return training_step(model, opt, lambda m: F.cross_entropy(m(x), y))


def run_one(name: str, seed: int, args) -> dict:
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = digits(seed, args.test_fraction)
    model = SmallCNN(in_channels=1, width=args.width, n_classes=10)
    opt = geomopt.GeomOptimizer(model, _common.spec_path(OPTIMIZERS[name]))
    if args.lr:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] = args.lr
    steps_per_epoch = math.ceil(len(xtr) / args.batch)
    total = args.epochs * steps_per_epoch
    warm = max(1, int(0.1 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min((k + 1) / warm, max(0.0, (total - k) / (total - warm))))
    gen = torch.Generator().manual_seed(seed + 1)
    curve = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(xtr), args.batch):
            idx = perm[i : i + args.batch]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        curve.append((epoch, accuracy(model, xtr, ytr), accuracy(model, xte, yte)))
    seconds = time.perf_counter() - start
    diag = opt.diagnostics()
    return dict(optimizer=name, seed=seed, test_acc=curve[-1][2], train_acc=curve[-1][1], seconds=round(seconds, 2),
                curve=curve, fallbacks={k: v.get("fallbacks") for k, v in diag.items() if isinstance(v, dict)})


def plot(runs, summary, path: Path, args) -> bool:
    plt = _common.pyplot()
    if plt is None:
        return False
    names = list(summary)
    colors = dict(zip(names, ["C0", "C1", "C2", "C3"]))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11.5, 4.2))
    for n in names:
        rs = [r for r in runs if r["optimizer"] == n]
        ep = [c[0] for c in rs[0]["curve"]]
        mean = [sum(r["curve"][i][2] for r in rs) / len(rs) for i in range(len(ep))]
        ax0.plot(ep, mean, color=colors[n], label=n)
    ax0.set_xlabel("epoch")
    ax0.set_ylabel(f"test accuracy (mean over {len(args.seed_list)} seed(s))")
    ax0.set_title("SmallCNN on scikit-learn digits (8×8)")
    lo = min(min(r["curve"][-1][2] for r in runs), 0.9)
    ax0.set_ylim(max(0.0, lo - 0.02), 1.0)
    ax0.legend(fontsize=8)
    ax0.grid(alpha=0.3)
    for i, n in enumerate(names):
        accs = summary[n]["test_acc"]
        ax1.scatter([i] * len(accs), accs, color=colors[n], alpha=0.6)
        ax1.errorbar(i, summary[n]["mean"], yerr=summary[n]["std"], color="k", capsize=6, marker="_", ms=20)
    ax1.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax1.set_ylabel("final test accuracy (bar: mean ± std)")
    ax1.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--test-fraction", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=0.0, help="override the specs' lr (default: the spec's)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of: " + ", ".join(OPTIMIZERS))
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, width 8 (for tests)")
    add_threads_arg(ap)
    _common.add_output_args(ap, "digits_cnn")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    out = _common.resolve_output(ap, args, "digits_cnn")
    if args.quick:
        args.seeds, args.epochs, args.width = 1, 1, 8
    args.seed_list = list(range(args.seed0, args.seed0 + args.seeds))
    names = _common.chosen_optimizers(ap, args.optimizers, OPTIMIZERS)
    threads = choose_threads(args.threads, lambda: probe_step(names[0], args))
    print(threads.header(), flush=True)
    t0 = time.perf_counter()
    runs = []
    for seed in args.seed_list:
        for name in names:
            r = run_one(name, seed, args)
            runs.append(r)
            print(f"seed {seed} {name:<32} test acc {r['test_acc']:.4f} (train {r['train_acc']:.4f}, {r['seconds']:.1f} s)", flush=True)
    summary = {}
    for n in names:
        accs = [r["test_acc"] for r in runs if r["optimizer"] == n]
        m, s = _common.mean_std(accs)
        summary[n] = dict(spec=_common.spec_label(OPTIMIZERS[n]), test_acc=accs, mean=m, std=s,
                          seconds=round(sum(r["seconds"] for r in runs if r["optimizer"] == n), 1))
    total = time.perf_counter() - t0
    print("\n| optimizer | spec | test accuracy (mean ± std) | min | max | time (s) |")
    print("|---|---|---|---|---|---|")
    for n, s in summary.items():
        print(f"| {n} | {s['spec']} | {100 * s['mean']:.2f} ± {100 * s['std']:.2f} % | {100 * min(s['test_acc']):.2f} | "
              f"{100 * max(s['test_acc']):.2f} | {s['seconds']} |")
    print(f"total {total:.1f} s")
    settings = _common.settings_of(args, optimizers=names)
    _common.write_results(out / "digits_cnn.json", settings=settings, results=dict(summary=summary, runs=runs), seconds=total,
                          threads=threads)
    if plot(runs, summary, out / "digits_cnn.png", args):
        print(f"wrote {out / 'digits_cnn.json'} and {out / 'digits_cnn.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
