"""How far one round trip of the optimizer state through bf16, int8 or int8-ec moves the next update,
rule by rule: where state precision costs training quality, and why.

    python benchmarks/state_update_error.py [--run char_gpt|demo] [--steps 300] [--seed 0] [--record NOTE]

The run's training (benchmarks/state_quality.py's runs: the byte-level GPT, its spec) goes
``--steps`` steps with float32 state; from there it goes two steps more four times, on the same two
batches, with the spec's state in float32, bfloat16, int8 and int8-ec (the first step still reads float32
state, as a checkpoint loaded under another precision does, and encodes it; the second decodes it).
The first step's parameters are equal, so the second step's gradients are too, and the second
step's parameter change Δθ differs by the state's round trip alone. Reported per rule (its tensors
together): ‖d̃ − d‖ / ‖d‖ of the state the second step read (every state entry the rule keeps) and
‖Δθ̃ − Δθ‖ / ‖Δθ‖ of the update, against float32's; and, for a rule's matrices, how many of the
float32 momentum's singular values lie below 10⁻³ of its Frobenius norm (the median over the rule's
matrices): directions a spectral map (Newton–Schulz, Polar Express, a power barrier's ε) leaves
near zero, and into which a quantizer's full-rank noise puts about 1% of that norm. Writes
benchmarks/results/state_update_error-<run>.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402
from state_quality import PRECISIONS, RUNS, with_state  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import batches, corpus_bytes, train  # noqa: E402
from geomopt.optim.persist.state_codec import decode_entry  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"bfloat16": "bf16", "int8": "int8", "int8-ec": "int8-ec"}
RESULTS = ROOT / "benchmarks" / "results"
NULL = 1e-3  # a singular value below NULL · ‖d‖_F counts as the momentum's near-null space


def two_steps(model, opt, pair) -> tuple[dict, dict, dict]:
    """The state each tensor's second step read (decoded to float32), the second step's change and the
    parameters it started from."""
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    step(*pair[0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    read = {n: _decoded(opt, p) for n, p in model.named_parameters()}
    step(*pair[1])
    return read, {n: p.detach() - before[n] for n, p in model.named_parameters()}, before


def _decoded(opt, p) -> dict:
    return {k: v.float().clone() for k, v in decode_entry(dict(opt.state.get(p, {}))).items()
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0}


def _rel(a: list, b: list) -> float:
    num = sum(float((x - y).double().square().sum()) for x, y in zip(a, b))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / den) ** 0.5 if den else 0.0


def near_null(d: torch.Tensor) -> float:
    """The share of a matrix's singular values below NULL of its Frobenius norm."""
    s = torch.linalg.svdvals(d.double().reshape(d.shape[0], -1))
    return float((s < NULL * s.square().sum().sqrt()).double().mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", choices=sorted(RUNS), default="char_gpt", help="whose spec (default: char_gpt)")
    p.add_argument("--steps", type=int, default=300, help="float32 steps before the two measured ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON (default benchmarks/results/state_update_error-<run>.json)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    spec_path = ROOT / RUNS[args.run][0]
    spec = geomopt.load_spec(str(spec_path))
    held: dict = {}

    def make(m):
        held["model"], held["opt"] = m, geomopt.GeomOptimizer(m, with_state(spec, "float32"))
        return held["opt"]

    train(make, steps=args.steps, seed=args.seed, eval_every=args.steps, progress=False)
    model, opt = held["model"], held["opt"]
    raw = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    it = batches(raw[: int(0.9 * len(raw))], 64, 32, torch.Generator().manual_seed(args.seed + 7))
    pair = [next(it), next(it)]
    rule_of = {pp.name: pp.rule for pp in opt.plan.params}
    runs = {}
    for dtype in PRECISIONS:
        m = copy.deepcopy(model)
        o = geomopt.GeomOptimizer(m, with_state(spec, dtype))
        o.load_state_dict(copy.deepcopy(opt.state_dict()), allow_spec_change=True)
        runs[dtype] = two_steps(m, o, pair)
    ref_read, ref_step, ref_start = runs["float32"]
    # the first step read float32 state under every precision: the second starts from the same parameters
    # but for float rounding (an elementwise rule whose state is encoded runs batched, not fused)
    start_dev = max(float((runs[d][2][n] - x).abs().max() / x.abs().max().clamp(min=1e-30))
                    for d in PRECISIONS for n, x in ref_start.items())
    rows = []
    for rule in dict.fromkeys(rule_of.values()):
        names = [n for n, r in rule_of.items() if r == rule]
        row: dict = dict(rule=rule, tensors=len(names))
        for dtype in PRECISIONS[1:]:
            read, step, _ = runs[dtype]
            keys = [(n, k) for n in names for k in ref_read[n]]
            row[f"state_{dtype}"] = _rel([read[n][k] for n, k in keys], [ref_read[n][k] for n, k in keys])
            row[f"update_{dtype}"] = _rel([step[n] for n in names], [ref_step[n] for n in names])
        mats = [ref_read[n]["d"] for n in names if "d" in ref_read[n] and ref_read[n]["d"].dim() >= 2]
        row["near_null"] = statistics.median(map(near_null, mats)) if mats else None
        rows.append(row)
    out = Path(args.out) if args.out else RESULTS / f"state_update_error-{args.run}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(run=args.run, spec=spec_path.name, steps=args.steps, seed=args.seed,
                                   torch=torch.__version__, date=datetime.date.today().isoformat(), rows=rows),
                              indent=2) + "\n")
    lines = [f"### State round trip and the next update: {args.run}'s training ({spec_path.name}, after "
             f"{args.steps} float32 steps, seed {args.seed}), torch {torch.__version__} — "
             f"{datetime.date.today().isoformat()}", "",
             "| rule | tensors | " + " | ".join(f"state error {SHORT[d]}" for d in PRECISIONS[1:]) + " | "
             + " | ".join(f"update error {SHORT[d]}" for d in PRECISIONS[1:])
             + f" | momentum σ < {NULL:g}‖d‖ (median share) |", "|---" * (3 + 2 * len(PRECISIONS[1:])) + "|"]
    for r in rows:
        null = "—" if r["near_null"] is None else f"{r['near_null']:.2f}"
        lines.append(f"| {r['rule']} | {r['tensors']} | " + " | ".join(f"{r['state_' + d]:.4f}" for d in PRECISIONS[1:])
                     + " | " + " | ".join(f"{r['update_' + d]:.3f}" for d in PRECISIONS[1:]) + f" | {null} |")
    lines += ["", f"The second steps' starting parameters differ by at most {start_dev:.1e} of a tensor's largest "
                  "entry (float rounding of the first step)."]
    if start_dev > 1e-5:
        print("\n".join(lines) + "\nthe second steps started from different parameters: the errors are not the state's")
        return 1
    emit("\n".join(lines), args.record, "State round trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
