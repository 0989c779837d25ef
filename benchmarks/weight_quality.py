"""What keeping the weights in bfloat16 costs in training quality, with and without compensation
(a rule's ``state: {compensation: int8|int16}``), against float32 master weights: the demo's
training (the byte-level GPT of ``geomopt demo``) with every forward in bf16 in all rows.

    python benchmarks/weight_quality.py [--run demo|char_gpt] [--seeds 0 1 2] [--record NOTE]

Rows, at each seed from the same initial weights (cast) and the same batches:

* ``float32 weights (autocast bf16)``: the reference, mixed precision as torch's AMP does it
  (float32 parameters, the forward under ``torch.autocast(bfloat16)``);
* ``… lr × (1 + 1e-6) (control)``: the same with every lr 1e-6 larger: how far the training amplifies
  any perturbation at all;
* ``bf16 weights, compensation int16`` / ``int8``: the model cast to bf16, the spec's rules with
  that compensation (and their state precision as the spec has it);
* ``bf16 weights, no compensation``: the model cast to bf16, updates rounded away as they fall.

Reported per row: the mean over seeds of its final validation loss (nats/byte, cross-entropy in
float32) minus the reference's at the same seed, ± their standard deviation, and bytes per
parameter held after training (weights + optimizer state). Writes
benchmarks/results/weight_quality-<run>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import train  # noqa: E402
from geomopt.models.gpt import GPT, GPTConfig  # noqa: E402
from state_quality import RUNS  # noqa: E402  (the same trainings: spec and steps by run)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REFERENCE = "float32 weights (autocast bf16)"
CONTROL = "float32 weights (autocast bf16), lr × (1 + 1e-6) (control)"
ROWS = {  # label → (weights dtype, compensation or None: the spec as it is, lr scale, state precision)
    REFERENCE: (torch.float32, None, 1.0, None),
    CONTROL: (torch.float32, None, 1.0 + 1e-6, None),
    "bf16 weights, compensation int16": (torch.bfloat16, "int16", 1.0, None),
    "bf16 weights, compensation int8": (torch.bfloat16, "int8", 1.0, None),
    "bf16 weights, compensation int8, bf16 state": (torch.bfloat16, "int8", 1.0, "bfloat16"),
    "bf16 weights, no compensation": (torch.bfloat16, None, 1.0, None),
}


def with_compensation(spec: geomopt.Spec, compensation, lr_scale: float, state=None) -> geomopt.Spec:
    """``spec`` with every rule's ``compensation`` set (and its state precision, where given) and
    every lr scaled."""
    data = spec.model_dump(exclude_none=True)
    defaults = data.setdefault("defaults", {})
    for place in (defaults, *data["rules"]):
        if place is defaults or "state" in place:
            changed = dict(place.get("state") or {})
            changed.update({} if compensation is None else {"compensation": compensation})
            changed.update({} if state is None else {"dtype": state})
            place["state"] = changed
    for rule in data["rules"]:
        if lr_scale != 1.0:
            rule["lr"] = rule.get("lr", defaults.get("lr", 0.02)) * lr_scale
    return geomopt.Spec.model_validate(data)


def held_bytes(params: list, opt) -> float:
    """Bytes per parameter of the weights and every tensor of their optimizer state."""
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(v.numel() * v.element_size() for p in params for v in opt.state[p].values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return held / sum(p.numel() for p in params)


def by_rule(opt) -> dict:
    """Bytes per parameter per rule, and over all."""
    out = {g["rule"]: round(held_bytes(g["params"], opt), 3) for g in opt.param_groups}
    out["all"] = round(held_bytes([p for g in opt.param_groups for p in g["params"]], opt), 3)
    return out


def run_one(spec: geomopt.Spec, dtype, seed: int, steps: int) -> tuple[float, dict]:
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    autocast = dtype == torch.float32
    built: dict = {}

    def build():
        return GPT(config).to(dtype)

    def loss(m, x, y):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = m(x)
        value = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        return value, value

    def make_opt(model):
        built["model"], built["opt"] = model, geomopt.GeomOptimizer(model, spec)
        return built["opt"]

    out = train(make_opt, steps=steps, seed=seed, build=build, loss=loss, progress=False, eval_every=steps)
    return out["val"][-1], by_rule(built["opt"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", choices=sorted(RUNS), default="demo")
    p.add_argument("--steps", type=int, help="default: the run's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--without", nargs="+", default=[], metavar="ROW",
                   help="leave out the rows whose label contains any of these (e.g. int16)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/weight_quality-<run>.json)")
    p.add_argument("--again", action="store_true", help="run every row anew (default: keep the rows the "
                   "results file already holds for these seeds)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec_path, steps = RUNS[args.run]
    steps = args.steps or steps
    spec = geomopt.load_spec(ROOT / spec_path)
    rows_run = {k: v for k, v in ROWS.items() if k == REFERENCE or not any(w in k for w in args.without)}
    out = Path(args.out) if args.out else RESULTS / f"weight_quality-{args.run}.json"
    # runs already in the results file (same run, steps and torch) are kept, not run again: a row
    # added later runs alone (--without the others) and joins the same table
    done: dict = {}
    held: dict = {}
    if out.exists() and not args.again:
        old = json.loads(out.read_text())
        if (old["run"], old["steps"], old["torch"]) == (args.run, steps, torch.__version__):
            for r in old["rows"]:
                done[r["label"]] = dict(zip(old["seeds"], r["final"]))
                held[r["label"]] = r["bytes_per_param"]
    for seed in args.seeds:
        for label, (dtype, compensation, scale, state) in rows_run.items():
            if seed in done.get(label, {}):
                continue
            final, held[label] = run_one(with_compensation(spec, compensation, scale, state), dtype, seed, steps)
            done.setdefault(label, {})[seed] = final
            print(f"seed {seed} {label}: {final:.4f}", flush=True)
    labels = [k for k in ROWS if k in done and all(seed in done[k] for seed in args.seeds)]
    finals = {label: [done[label][seed] for seed in args.seeds] for label in labels}
    ref = finals[REFERENCE]
    rows = []
    for label, values in finals.items():
        diffs = [v - r for v, r in zip(values, ref)]
        rows.append(dict(label=label, final=values, diff_mean=statistics.fmean(diffs),
                         diff_std=statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                         diff_max=max(diffs, key=abs), bytes_per_param=held[label]))
    result = dict(run=args.run, spec=spec_path, steps=steps, seeds=args.seeds, rows=rows,
                  torch=torch.__version__, date=datetime.date.today().isoformat())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"### Low-precision weights and quality: {args.run}'s training ({Path(spec_path).name}, {steps} steps, "
             f"{len(args.seeds)} seed(s) {', '.join(map(str, args.seeds))}), torch {torch.__version__} — "
             f"{datetime.date.today().isoformat()}", "",
             "Every forward in bf16; final validation loss (nats/byte) minus the float32-weights reference's at the "
             "same seed; bytes per parameter held after training (weights + optimizer state).", "",
             "| weights | − reference, mean ± std over seeds | largest − reference | bytes / parameter, by rule |",
             "|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['diff_mean']:+.4f} ± {r['diff_std']:.4f} | {r['diff_max']:+.4f} | "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["bytes_per_param"].items()) + " |" for r in rows]
    emit("\n".join(lines), args.record, "Low-precision weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
