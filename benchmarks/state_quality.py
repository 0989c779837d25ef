"""What keeping optimizer state in bf16 or int8 costs in training quality: the demo's training (the
byte-level GPT of ``geomopt demo``, its spec, steps and seed) with the spec's ``state`` set to
float32, bfloat16, int8 and int8-ec for every rule, final validation loss in nats/byte.

    python benchmarks/state_quality.py [--run demo|char_gpt] [--seeds 0 1 2] [--mixed RULE=DTYPE ...]
                                       [--precisions P ...] [--no-control] [--record NOTE]
    python benchmarks/state_quality.py --spec specs/spectral-clip.yaml --steps 800 --seeds 0

``--run demo``: ``geomopt demo``'s spec and steps (spectral-clip.yaml, 800); ``--run char_gpt``:
examples/char_gpt.py's proximal Frobenius run (prox-muon-frobenius.yaml, its default 600 steps);
both train the same byte-level GPT (2 layers, width 64). At each seed every run starts from the same
weights and sees the same batches, so the differences are the state's precision alone. A control
row, float32 state with every lr made 1e-6 larger, shows how far the training amplifies any
perturbation at all (a small model's loss after hundreds of steps is chaotic in its inputs: one
seed's difference is mostly that). Reported per precision: the mean over seeds of its final
validation loss minus float32's at the same seed, ± their standard deviation, and the bytes its state
holds over float32's. ``--mixed hidden=bfloat16``: one row more, int8 state but the rules named
(where int8 costs quality, benchmarks/state_update_error.py says which rule and why). Writes
benchmarks/results/state_quality-<run>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PRECISIONS = ("float32", "bfloat16", "int8", "int8-ec")
RUNS = {"demo": ("specs/spectral-clip.yaml", 800), "char_gpt": ("specs/prox-muon-frobenius.yaml", 600)}
CONTROL = "float32, lr × (1 + 1e-6) (control)"


def with_state(spec: geomopt.Spec, dtype: str, lr_scale: float = 1.0, rules: dict | None = None) -> geomopt.Spec:
    """``spec`` with every rule's state in ``dtype`` but the rules named in ``rules`` (name → dtype)."""
    data = spec.model_dump(exclude_none=True)
    data["defaults"] = dict(data.get("defaults") or {}, state={"dtype": dtype})
    for rule in data["rules"]:
        rule.pop("state", None)
        if rule.get("name") in (rules or {}):
            rule["state"] = {"dtype": rules[rule["name"]]}  # type: ignore[index]
        if lr_scale != 1.0:
            rule["lr"] = rule.get("lr", data["defaults"].get("lr", 0.02)) * lr_scale
    return geomopt.Spec.model_validate(data)


def state_bytes(opt) -> int:
    """Bytes of every tensor the optimizer's state holds (codes, scales, moments)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", choices=sorted(RUNS), default="demo", help="whose spec and steps (default: demo)")
    p.add_argument("--spec", help="another spec (default: the run's)")
    p.add_argument("--steps", type=int, help="default: the run's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", help="results JSON (default benchmarks/results/state_quality-<run>.json)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                   help="the precisions compared (default: all; float32 is always run, the others' reference)")
    p.add_argument("--no-control", action="store_true", help="leave out the control row (float32, lr × (1 + 1e-6))")
    p.add_argument("--mixed", nargs="+", metavar="RULE=DTYPE",
                   help="one row more: int8 state but these rules' (e.g. hidden=bfloat16)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    mixed = dict(kv.split("=", 1) for kv in args.mixed or [])
    precisions = [d for d in PRECISIONS if d in args.precisions or d == "float32"]
    mixed_row = "int8, " + ", ".join(f"{k} {v}" for k, v in mixed.items())
    spec_path = args.spec or str(ROOT / RUNS[args.run][0])
    steps = args.steps or RUNS[args.run][1]
    spec = geomopt.load_spec(spec_path)
    runs = []
    for seed in args.seeds:
        # the control: float32 state with every lr 1e-6 larger, a perturbation far below any precision's;
        # how far it moves the final loss is how far this training amplifies any difference
        variants = [(d, d, 1.0, None) for d in precisions] + ([] if args.no_control else
                                                               [(CONTROL, "float32", 1 + 1e-6, None)])
        for label, dtype, scale, rules in variants + ([(mixed_row, "int8", 1.0, mixed)] if mixed else []):
            variant = with_state(spec, dtype, scale, rules)
            held: list = []
            r = train(lambda m, s=variant, h=held: h.append(geomopt.GeomOptimizer(m, s)) or h[-1], steps=steps,
                      seed=seed, label=f"state {label}", eval_every=max(1, steps // 20), progress=False)
            runs.append(dict(state=label, seed=seed, val=r["val"][-1], train=r["train"][-1], seconds=r["seconds"],
                             state_bytes=state_bytes(held[-1])))
            print(f"seed {seed} {runs[-1]['state']}: val {r['val'][-1]:.4f}", flush=True)
    base = {r["seed"]: r["val"] for r in runs if r["state"] == "float32"}
    rows = []
    base_bytes = next(r["state_bytes"] for r in runs if r["state"] == "float32")
    for state in [*precisions] + ([] if args.no_control else [CONTROL]) + ([mixed_row] if mixed else []):
        diffs = [r["val"] - base[r["seed"]] for r in runs if r["state"] == state]
        vals = [r["val"] for r in runs if r["state"] == state]
        nbytes = next(r["state_bytes"] for r in runs if r["state"] == state)
        rows.append(dict(state=state, val_mean=statistics.fmean(vals), diff_mean=statistics.fmean(diffs),
                         diff_std=statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                         diff_max=max(diffs, key=abs), bytes_ratio=nbytes / base_bytes))
    out = Path(args.out) if args.out else RESULTS / f"state_quality-{args.run}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(run=args.run, spec=Path(spec_path).name, steps=steps, seeds=args.seeds,
                                   torch=torch.__version__, date=datetime.date.today().isoformat(), rows=rows,
                                   runs=runs), indent=2) + "\n")
    n = len(args.seeds)
    lines = [f"### State precision and quality: {args.run}'s training ({Path(spec_path).name}, {steps} steps, "
             f"{n} seed(s) {', '.join(map(str, args.seeds))}), torch {torch.__version__} — "
             f"{datetime.date.today().isoformat()}", "",
             "| state | final val, mean (nats/byte) | − float32, mean ± std over seeds | largest − float32 "
             "| state bytes / float32's |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['state']} | {r['val_mean']:.4f} | {r['diff_mean']:+.4f} ± {r['diff_std']:.4f} | "
              f"{r['diff_max']:+.4f} | {r['bytes_ratio']:.3f} |" for r in rows]
    emit("\n".join(lines), args.record, "State precision")
    return 0


if __name__ == "__main__":
    sys.exit(main())
