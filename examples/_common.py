"""Shared helpers for the paper-reproduction examples: spec paths, the output folder, the results
record (JSON with the exact command line, settings, timings, the machine, torch version and date)
and small formatting helpers. The byte-level GPT training loop and plot live in
:mod:`geomopt.cli.demo` and are reused from there (``corpus_bytes``, ``train``, ``plot``), as is
the output convention: ``--out DIR`` (default ``runs/<name>/`` under the current directory,
git-ignored), and ``--record``, which rewrites the committed ``examples/results/<name>.*``."""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

from geomopt.cli.demo import RECORD_REPEATS, machine, output_dir, source_version

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
RESULTS = Path(__file__).resolve().parent / "results"  # the committed results (written with --record only)


def add_output_args(parser, name: str, *, repeats: bool = False, timed: bool = True) -> None:
    """``--out DIR`` and ``--record`` (and ``--repeats N`` where the timed runs are repeated);
    ``timed``: the script records timings (and so the machine)."""
    parser.add_argument("--out", metavar="DIR", help=f"output folder (default: runs/{name}/ under the current "
                        "directory, git-ignored; with --record: examples/results/)")
    what = f", timing each training --repeats times (default {RECORD_REPEATS})" if repeats else ""
    what += ", with the machine" if timed else ""
    parser.add_argument("--record", action="store_true",
                        help=f"record mode: rewrite the committed examples/results/{name}.* (or --out){what}")
    if repeats:
        parser.add_argument("--repeats", type=int, help=f"timed runs of each training (default 1; {RECORD_REPEATS} "
                            "with --record): the docs show their min–max")


def resolve_output(parser, args, name: str) -> Path:
    """The output folder of ``args`` (a usage error where it would rewrite the committed results
    without --record); sets ``args.repeats`` where the script has it."""
    if hasattr(args, "repeats"):
        if args.repeats is not None and args.repeats < 1:
            parser.error("--repeats must be at least 1")
        args.repeats = args.repeats or (RECORD_REPEATS if args.record else 1)
    try:
        return output_dir(args.out, args.record, name, results=RESULTS)
    except ValueError as exc:
        parser.error(str(exc))


def spec_path(name: str) -> Path:
    """An example's own spec (specs/examples/) or a shipped one (specs/)."""
    own = SPECS / "examples" / f"{name}.yaml"
    return own if own.exists() else SPECS / f"{name}.yaml"


def spec_label(name: str) -> str:
    """The spec's path as the docs and the results name it."""
    return str(spec_path(name).relative_to(ROOT))


def chosen_optimizers(parser, text: str, known) -> list[str]:
    """The comma-separated ``--optimizers`` names, each one of ``known`` (else a usage error)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown optimizer(s) {sorted(unknown)}; choose from {list(known)}")
    return names


def command_line() -> str:
    """``python examples/NAME.py ARGS``: the command as run, the script named from the checkout's root."""
    if not (sys.argv and sys.argv[0]):
        return "python"
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(ROOT)) if ROOT in script.parents else sys.argv[0]
    return " ".join(shlex.quote(a) for a in ["python", shown, *sys.argv[1:]])


def settings_of(args, **more) -> dict:
    """The run's settings for the record: its arguments less the output folder, plus ``more``."""
    return {**{k: v for k, v in vars(args).items() if k != "out"}, **more}


def write_results(path: Path, *, settings: dict, results: dict, seconds: float, extra: dict | None = None,
                  device: str = "cpu", threads=None) -> dict:
    """Write the results record ``path`` (JSON): command, date, versions, the machine (CPU model,
    cores, threads; the GPU on CUDA), how the thread count was chosen (``threads``, a
    :class:`geomopt.cli.threads.ThreadChoice`), the source commit, total seconds, settings and results."""
    import torch

    record = {
        "command": command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "thread_choice": threads.record() if threads is not None else None,
        "machine": machine(device),
        "source": source_version(ROOT),
        "seconds_total": round(seconds, 2),
        "settings": settings,
        "results": results,
    }
    if extra:
        record.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def mean_std(xs):
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
