"""The README's two commands on a busy machine: `geomopt demo --quick` and a fixed subset of the
test suite, each run quiet and with one busy core beside it (another process spinning on one core,
as a browser tab or a second job would), interleaved, their median wall times and the ratio of
busy to quiet. Goal: at most 1.5x for both.

The demo runs as a user runs it (no OMP_NUM_THREADS: it probes its thread count); the tests run
as the README's test command (tests/conftest.py sets their thread count). A control row runs the
demo at torch's default of one thread per core (``--threads`` = the core count), which is what
every run did before the demo chose its count: it shows what the choice is worth.

    python benchmarks/busy_machine.py [--repeats 3] [--only demo,control,tests] [--record]

``--record`` writes benchmarks/results/busy_machine.json (the README quotes it); otherwise the
record goes to runs/busy_machine.json. The machine's load average is read before every run."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geomopt.cli.demo import machine, source_version  # noqa: E402
from geomopt.cli.threads import machine_load, usable_cores  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "busy_machine.json"
#: the fixed subset of the tests: spec parsing, matching, the operators' math, optimizer steps
TESTS = ["tests/test_dsl_front.py", "tests/test_match.py", "tests/test_forward.py", "tests/test_stages.py",
         "tests/test_optimizer.py"]
GOAL = 1.5


def jobs(out: Path, steps: int | None = None) -> dict[str, tuple[str, list[str]]]:
    """(the command as the table shows it, its argv) by key: demo, control, tests; ``steps``: the
    demo's steps where not --quick's."""
    demo = [sys.executable, "-m", "geomopt", "demo", "--quick", "--no-progress", "--out", str(out),
            *(["--steps", str(steps)] if steps else [])]
    cores = usable_cores()
    return {
        "demo": ("geomopt demo --quick", demo),
        "control": (f"geomopt demo --quick --threads {cores} (control: one thread per core)",
                    [*demo, "--threads", str(cores)]),
        "tests": ("python -m pytest -q " + " ".join(TESTS),
                  [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]),
    }


def timed(cmd: list[str]) -> tuple[float, list[float] | None]:
    """(wall seconds, the load averages before) of ``cmd`` run from the checkout, as a user runs
    it (OMP_NUM_THREADS and MKL_NUM_THREADS unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    load = machine_load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return seconds, list(load) if load else None


class BusyCore:
    """Another process spinning on one core while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)  # let it take its core
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        time.sleep(2.0)  # let the machine go quiet again


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each command in each condition (default 3)")
    ap.add_argument("--only", default="demo,control,tests", help="comma-separated subset of demo, control, tests")
    ap.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(ROOT)} (the README quotes it)")
    ap.add_argument("--steps", type=int, help="the demo's steps (default: --quick's; not with --record)")
    ap.add_argument("--out", metavar="DIR", default="runs", help="folder for busy_machine.json without --record")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        every = jobs(Path(tmp), args.steps)
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        if not keys or set(keys) - set(every) or (args.record and (set(keys) != set(every) or args.steps)):
            ap.error(f"--only takes a subset of {', '.join(every)} (all of them, and no --steps, with --record), got {args.only!r}")
        commands = dict(every[k] for k in keys)
        runs: dict[str, dict[str, list]] = {name: {"quiet": [], "busy": []} for name in commands}
        for k in range(args.repeats):  # interleaved: a drift in the machine's load reaches every row
            for name, cmd in commands.items():
                runs[name]["quiet"].append(timed(cmd))
                with BusyCore():
                    runs[name]["busy"].append(timed(cmd))
                print(f"[{k + 1}/{args.repeats}] {name}: quiet {runs[name]['quiet'][-1][0]:.1f} s, "
                      f"busy {runs[name]['busy'][-1][0]:.1f} s", flush=True)
    rows = []
    for name, r in runs.items():
        quiet = statistics.median(s for s, _ in r["quiet"])
        busy = statistics.median(s for s, _ in r["busy"])
        rows.append(dict(command=name, control="control" in name, quiet_s=round(quiet, 2), busy_s=round(busy, 2),
                         ratio=round(busy / quiet, 3), quiet_runs=[round(s, 2) for s, _ in r["quiet"]],
                         busy_runs=[round(s, 2) for s, _ in r["busy"]],
                         load_before_quiet=[ld for _, ld in r["quiet"]], load_before_busy=[ld for _, ld in r["busy"]]))
    print(f"\n| command | quiet (s) | one busy core (s) | busy / quiet (goal ≤ {GOAL}) |\n|---|---|---|---|")
    for row in rows:
        print(f"| `{row['command']}` | {row['quiet_s']:.1f} | {row['busy_s']:.1f} | {row['ratio']:.2f} |")
    record = dict(command="python benchmarks/busy_machine.py" + (" --record" if args.record else "")
                  + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  repeats=args.repeats, goal=GOAL, tests=TESTS, machine=machine(), source=source_version(ROOT),
                  rows=rows)
    path = RECORD if args.record else Path(args.out) / "busy_machine.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
