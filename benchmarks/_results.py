"""Shared by the benchmark scripts: print a result table and, with a note, append it to
benchmarks/RESULTS.md (every figure there carries its device, date and torch version)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def emit(text: str, note: str | None) -> None:
    if note:
        text += f"\n\n{note}\n"
    print(text)
    if note:
        with RESULTS.open("a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")


def round_robin(rows: list, iters: int, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, median ms) of each ``(name, fn)`` row, calling the rows in turn ``iters`` times after
    ``warmup`` untimed rounds: the machine's drift hits every row alike."""
    for _ in range(warmup):
        for _, fn in rows:
            fn()
    times: dict = {name: [] for name, _ in rows}
    for _ in range(iters):
        for name, fn in rows:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return [(name, statistics.median(times[name])) for name, _ in rows]


def ratio_table(heading: str, what: str, against: str, rows: list) -> str:
    """A markdown table of ``(name, median ms)`` rows, each with its ratio to the first row's."""
    base = rows[0][1]
    lines = [heading, "", f"| {what} | step (ms, median) | × {against} |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {ms / base:.3f} |" for name, ms in rows]
    return "\n".join(lines)
