"""Shared helpers for the paper-reproduction examples: spec paths, the results record (JSON with
the exact command line, settings, timings, torch version and date) and small formatting helpers.
The byte-level GPT training loop and plot live in :mod:`geomopt.cli.demo` and are reused from
there (``corpus_bytes``, ``train``, ``plot``)."""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
RESULTS = Path(__file__).resolve().parent / "results"


def spec_path(name: str) -> Path:
    """An example's own spec (specs/examples/) or a shipped one (specs/)."""
    own = SPECS / "examples" / f"{name}.yaml"
    return own if own.exists() else SPECS / f"{name}.yaml"


def spec_label(name: str) -> str:
    """The spec's path as the README and the results name it."""
    return str(spec_path(name).relative_to(ROOT))


def chosen_optimizers(parser, text: str, known) -> list[str]:
    """The comma-separated ``--optimizers`` names, each one of ``known`` (else a usage error)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown optimizer(s) {sorted(unknown)}; choose from {list(known)}")
    return names


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv]) if sys.argv and sys.argv[0] else "python"


def write_results(path: Path, *, settings: dict, results: dict, seconds: float, extra: dict | None = None) -> dict:
    import torch

    record = {
        "command": command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
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
