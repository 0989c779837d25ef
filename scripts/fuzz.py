"""Fuzz the whole pipeline with N mutated specs and M mutated checkpoints; write the outcome as JSON.

    python scripts/fuzz.py --n 50000 --checkpoints 50000 --seed 0 --workers 1 --out benchmarks/results/fuzz.json

Spec mutant i of seed S is replayed alone with ``--replay S:i`` (prints the spec text and its
record), checkpoint mutant i with ``--replay-checkpoint S:i``; ``--recheck FILE`` reruns the
findings an outcome file lists, on the code as it is now, and adds what they give now to the file
(``recheck``). The spec mutants' outcome is the file's top level, the checkpoints' its
``checkpoints`` section.
The generators and the contracts are tests/spec_mutants.py with tests/fuzz_pipeline.py, and
tests/checkpoint_mutants.py with tests/fuzz_checkpoints.py; tests/test_fuzz_pipeline.py runs a
slice of each.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's geomopt, whose commit the outcome records
CHUNK = 250


def _chunk(args: tuple[str, int, int, int]) -> list[dict]:
    """The records of mutants ``lo`` to ``hi`` of one kind (``spec`` or ``checkpoint``)."""
    import torch

    kind, seed, lo, hi = args
    torch.set_num_threads(1)
    if kind == "checkpoint":
        from fuzz_checkpoints import run_checkpoint

        return [run_checkpoint(seed, i) for i in range(lo, hi)]
    import fuzz_pipeline

    models = _chunk.__dict__.setdefault("models", fuzz_pipeline.Models())
    return [fuzz_pipeline.run_mutant(seed, i, models) for i in range(lo, hi)]


def commit() -> str:
    """The checkout's commit, with ``+dirty`` where files differ from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + ("+dirty" if dirty.stdout.strip() else "")


def recheck(path: pathlib.Path) -> dict:
    """Rerun the findings of outcome file ``path`` on the current code; record what they give."""
    from fuzz_pipeline import FINDINGS, Models, run_mutant

    from fuzz_checkpoints import FINDINGS as CHECKPOINT_FINDINGS, run_checkpoint

    data = json.loads(path.read_text(encoding="utf-8"))
    models = Models()
    now = [run_mutant(data["seed"], r["i"], models) for r in data.get("findings", [])]
    points = data.get("checkpoints", {})
    now_points = [run_checkpoint(points["seed"], r["i"]) for r in points.get("findings", [])]
    data["recheck"] = {"commit": commit(), "n": len(now) + len(now_points),
                       "outcomes": dict(sorted(collections.Counter(r["outcome"] for r in now + now_points).items())),
                       "still_findings": [r for r in now if r["outcome"] in FINDINGS]
                       + [r for r in now_points if r["outcome"] in CHECKPOINT_FINDINGS]}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data["recheck"]


def summarize(records: list[dict], seed: int, seconds: float, workers: int, at: str) -> dict:
    from fuzz_pipeline import FINDINGS

    outcomes = collections.Counter(r["outcome"] for r in records)
    by_level: dict = {}
    for r in records:
        row = by_level.setdefault(f"{r['level']}/{r['fmt']}", {"n": 0, "valid": 0, "stepped": 0})
        row["n"] += 1
        row["valid"] += r["outcome"] not in ("parse_refused",) and r.get("stage") != "parse"
        row["stepped"] += r["outcome"] == "stepped"
    valid = sum(r.get("stage") != "parse" for r in records)
    slow = sorted(records, key=lambda r: -r["seconds"])[:10]
    return {
        "seed": seed, "n": len(records), "commit": at, "workers": workers, "seconds": round(seconds, 1),
        "mutants_per_s": round(len(records) / seconds, 1), "python": platform.python_version(),
        "outcomes": dict(sorted(outcomes.items())),
        "valid_share": round(valid / max(1, len(records)), 4),
        "stepped_share": round(outcomes["stepped"] / max(1, len(records)), 4),
        "nan_step_raised": sum(bool(r.get("nan_raised")) for r in records),
        "refused_changed": outcomes["refused_wrote"],
        "by_level": dict(sorted(by_level.items())),
        "findings": [r for r in records if r["outcome"] in FINDINGS][:200],
        "slowest": [{k: r.get(k) for k in ("i", "seconds", "model", "outcome", "level", "fmt")} for r in slow],
    }


def summarize_checkpoints(records: list[dict], seed: int, seconds: float) -> dict:
    """The checkpoint mutants' outcome: counts per outcome and per spec, the findings (which must
    be none: tracebacks, hangs, refusals that changed something or named nothing), the slowest."""
    from fuzz_checkpoints import FINDINGS

    outcomes = collections.Counter(r["outcome"] for r in records)
    by_spec: dict = {}
    for r in records:
        row = by_spec.setdefault(r.get("spec", "?"), {"n": 0, "stepped": 0, "refused": 0})
        row["n"] += 1
        row["stepped"] += r["outcome"] == "stepped"
        row["refused"] += r["outcome"] == "refused"
    slow = sorted(records, key=lambda r: -r["seconds"])[:10]
    return {
        "seed": seed, "n": len(records), "seconds": round(seconds, 1),
        "mutants_per_s": round(len(records) / max(seconds, 1e-9), 1),
        "outcomes": dict(sorted(outcomes.items())),
        "stepped_finite": outcomes["stepped"], "refused": outcomes["refused"],
        "tracebacks": outcomes["crash"] + outcomes["step_crash"], "hangs": outcomes["hang"],
        "refused_changed": outcomes["refused_wrote"], "refused_unnamed": outcomes["refusal_unnamed"],
        "nonfinite": outcomes["nonfinite"],
        "by_spec": dict(sorted(by_spec.items())),
        "findings": [r for r in records if r["outcome"] in FINDINGS][:200],
        "slowest": [{k: r.get(k) for k in ("i", "seconds", "spec", "outcome")} for r in slow],
    }


def _run(kind: str, n: int, start: int, seed: int, workers: int) -> tuple[list[dict], float]:
    """(records, seconds) of ``n`` mutants of ``kind`` from index ``start``, in chunks across ``workers``."""
    end = start + n
    jobs = [(kind, seed, lo, min(lo + CHUNK, end)) for lo in range(start, end, CHUNK)]
    t0, records = time.perf_counter(), []
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        for k, chunk in enumerate(pool.map(_chunk, jobs)):
            records += chunk
            if k % 20 == 0:
                print(f"{kind}: {len(records)}/{n} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return records, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="spec mutants")
    ap.add_argument("--checkpoints", type=int, default=0, help="checkpoint mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first mutant index")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON outcome file (default: print the summary)")
    ap.add_argument("--replay", default=None, metavar="SEED:I")
    ap.add_argument("--replay-checkpoint", default=None, metavar="SEED:I")
    ap.add_argument("--recheck", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.recheck:
        again = recheck(pathlib.Path(args.recheck))
        print(json.dumps({k: again[k] for k in ("commit", "n", "outcomes")}))
        return 1 if again["still_findings"] else 0
    if args.replay:
        from fuzz_pipeline import Models, run_mutant
        from spec_mutants import mutant

        seed, i = map(int, args.replay.split(":"))
        print(mutant(seed, i)[2])
        print(json.dumps(run_mutant(seed, i, Models())))
        return 0
    if args.replay_checkpoint:
        from fuzz_checkpoints import run_checkpoint

        seed, i = map(int, args.replay_checkpoint.split(":"))
        print(json.dumps(run_checkpoint(seed, i)))
        return 0
    at = commit()  # the code the workers load (a checkout changed during the run does not count)
    summary: dict = {}
    if args.n:
        records, seconds = _run("spec", args.n, args.start, args.seed, args.workers)
        summary = summarize(records, args.seed, seconds, args.workers, at)
        print(json.dumps({k: summary[k] for k in ("n", "seconds", "outcomes", "valid_share", "stepped_share")}))
    if args.checkpoints:
        records, seconds = _run("checkpoint", args.checkpoints, args.start, args.seed, args.workers)
        summary.setdefault("commit", at)
        summary.setdefault("workers", args.workers)
        summary["checkpoints"] = summarize_checkpoints(records, args.seed, seconds)
        print(json.dumps({k: summary["checkpoints"][k] for k in ("n", "seconds", "outcomes")}))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return 1 if summary.get("findings") or summary.get("checkpoints", {}).get("findings") else 0


if __name__ == "__main__":
    sys.exit(main())
