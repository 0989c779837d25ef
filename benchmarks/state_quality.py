"""What keeping optimizer state in bf16 or int8 costs in training quality: the demo's training (the
byte-level GPT of ``geomopt demo``, its spec, steps and seed) with the spec's ``state`` set to
float32, bfloat16 and int8 for every rule, final validation loss in nats/byte.

    python benchmarks/state_quality.py [--spec specs/spectral-clip.yaml] [--steps 800] [--seed 0] [--record NOTE]

Every run starts from the same weights and sees the same batches (the demo's seeded sampling), so
the differences are the state's precision alone. A control row, float32 state with every lr made
1e-6 larger, shows how far the training amplifies any perturbation at all (a small model's loss
after 800 steps is chaotic in its inputs). Writes benchmarks/results/state_quality.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.demo import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "state_quality.json"
PRECISIONS = ("float32", "bfloat16", "int8")


def with_state(spec: geomopt.Spec, dtype: str, lr_scale: float = 1.0) -> geomopt.Spec:
    data = spec.model_dump(exclude_none=True)
    data["defaults"] = dict(data.get("defaults") or {}, state={"dtype": dtype})
    for rule in data["rules"]:
        rule.pop("state", None)
        if lr_scale != 1.0:
            rule["lr"] = rule.get("lr", data["defaults"].get("lr", 0.02)) * lr_scale
    return geomopt.Spec.model_validate(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default=str(ROOT / "specs" / "spectral-clip.yaml"))
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--record", metavar="NOTE", help="append the table to benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    spec = geomopt.load_spec(args.spec)
    rows = []
    # the last row is the control: float32 state with every lr 1e-6 larger, a perturbation far below any
    # precision's; how far it moves the final loss is how far this training amplifies any difference
    for dtype, scale in [(d, 1.0) for d in PRECISIONS] + [("float32", 1 + 1e-6)]:
        variant = with_state(spec, dtype, scale)
        r = train(lambda m, s=variant: geomopt.GeomOptimizer(m, s), steps=args.steps, seed=args.seed,
                  label=f"state {dtype}", eval_every=max(1, args.steps // 20), progress=False)
        label = dtype if scale == 1.0 else "float32, lr × (1 + 1e-6) (control)"
        rows.append(dict(state=label, val=r["val"][-1], train=r["train"][-1], seconds=r["seconds"]))
    base = rows[0]["val"]
    for r in rows:
        r["val_minus_float32"] = r["val"] - base
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(spec=Path(args.spec).name, steps=args.steps, seed=args.seed,
                                              torch=torch.__version__, date=datetime.date.today().isoformat(),
                                              rows=rows), indent=2) + "\n")
    lines = [f"### State precision and quality: the demo's training ({Path(args.spec).name}, {args.steps} steps, "
             f"seed {args.seed}), torch {torch.__version__} — {datetime.date.today().isoformat()}", "",
             "| state | final val (nats/byte) | − float32 | final train | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {r['state']} | {r['val']:.4f} | {r['val_minus_float32']:+.4f} | {r['train']:.4f} | "
              f"{r['seconds']:.0f} |" for r in rows]
    emit("\n".join(lines), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
