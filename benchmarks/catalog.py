"""The catalogue's figures: every spec in specs/catalog/ against its independent reference
(the comparisons of tests/catalog_cases.py, which tests/test_catalog.py asserts), written to
benchmarks/results/catalog.json, from which ``python scripts/readme_tables.py`` renders the README's
catalogue table.

    python benchmarks/catalog.py                  # rewrite benchmarks/results/catalog.json
    python benchmarks/catalog.py --out runs/x.json [--only lion muon]   # elsewhere / a subset

Each case runs in both modes (same standard-normal gradients; each model's own LM loss) for the
case's number of steps, on one torch thread (as the test suite: the figures are rounding-level,
and a matmul's summation order may follow the thread count). The figure is the largest, over the
model's tensors, of ‖X_geomopt − X_ref‖_F / ‖X_ref − X_0‖_F. Runs in about half a minute on a
2-core CPU; needs transformers, pytorch-optimizer, lion-pytorch and scipy (the `test` extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "catalog.json"
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import catalog_cases  # noqa: E402
from catalog_cases import CASES, MODES, run  # noqa: E402


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "pytorch-optimizer", "lion-pytorch", "transformers", "scipy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def record(case, figures: dict) -> dict:
    """One case's entry: what was compared, how, and the measured figures per mode."""
    return dict(
        key=case.key, spec=f"specs/catalog/{case.key}.yaml", optimizer=case.optimizer, paper=case.paper,
        url=case.url, reference=case.reference, kind=case.kind, model=case.model, steps=case.steps,
        same_as=case.same_as,
        modes={mode: dict(max_rel=r["max_rel"], worst_tensor=r["worst_tensor"], global_rel=r["global_rel"],
                          bound=case.bound if mode == "same" else case.loss_bound,
                          why=case.why if mode == "same" else case.loss_why, seconds=round(r["seconds"], 4))
               for mode, r in figures.items()},
        state_geomopt=figures["same"]["state_geomopt"], state_reference=figures["same"]["state_reference"],
        params=figures["same"]["params"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON (default: %(default)s)")
    ap.add_argument("--only", nargs="+", metavar="KEY", help="these catalogue specs only")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from geomopt.cli.demo import machine, source_version

    cases = [c for c in CASES if not args.only or c.key in args.only]
    unknown = set(args.only or ()) - {c.key for c in cases}
    if unknown:
        ap.error(f"no catalogue spec {', '.join(sorted(unknown))} (known: {', '.join(c.key for c in CASES)})")
    t0 = time.perf_counter()
    entries, failures = [], []
    for case in cases:
        figures = {mode: run(case, mode) for mode in MODES}
        entry = record(case, figures)
        entries.append(entry)
        for mode, m in entry["modes"].items():
            ok = m["max_rel"] <= m["bound"]
            if not ok:
                failures.append(f"{case.key} ({mode})")
            print(f"{case.key:26s} {mode:4s} max rel {m['max_rel']:.3g} (bound {m['bound']:g}) "
                  f"on {m['worst_tensor']}{'' if ok else '  OVER THE BOUND'}")
    out = dict(
        command="python benchmarks/catalog.py" + (f" --only {' '.join(args.only)}" if args.only else ""),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        source=source_version(ROOT), machine=machine("cpu"), versions=versions(),
        modes={"same": "the same standard-normal gradients for both optimizers every step",
               "loss": "each model's own next-token loss on the step's fixed batch"},
        metric="max over tensors of ||X_geomopt - X_ref||_F / ||X_ref - X_0||_F",
        models={"gpt": f"geomopt.models.GPT {catalog_cases.GPT_CFG}",
                "gpt-clip": f"geomopt.models.GPT {catalog_cases.GPT_CFG}, hidden matrices x40",
                "llama": f"transformers.LlamaForCausalLM {catalog_cases.LLAMA_CFG}",
                "mla-clip": f"transformers.DeepseekV3ForCausalLM {catalog_cases.catalog_mla.MLA_CFG}, "
                            f"query/key rows x70"},
        seconds_total=round(time.perf_counter() - t0, 2), cases=entries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(entries)} specs, {out['seconds_total']:.1f} s)")
    if failures:
        print(f"over their bounds: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
