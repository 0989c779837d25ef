"""Shared by the benchmark scripts: print a result table and, with a note, append it to
benchmarks/RESULTS.md (every figure there carries its device, date and torch version)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def emit(text: str, note: str | None) -> None:
    if note:
        text += f"\n\n{note}\n"
    print(text)
    if note:
        with RESULTS.open("a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")
