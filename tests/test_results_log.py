"""benchmarks/RESULTS.md holds the current figures only: one ``## `` section per benchmark naming
the script that produces it, the newest record of each configuration under it (headed with its date
and torch version); a recorded table replaces its configuration's record in place
(benchmarks/_results.py), on a copy of a log here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "benchmarks" / "RESULTS.md"


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "benchmarks" / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(heading: str, rows: dict, note: str) -> str:
    lines = [f"### {heading}", "", "| optimizer | step (ms) |", "|---|---|"]
    return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows.items()] + ["", note])


LOG_TEXT = "\n".join([
    "# Benchmark results", "", "## Step (`benchmarks/step.py`)", "", "What it measures.", "",
    _table("gpt-bench on CPU — 2026-11-22, torch 2.13.0", {"muon": "30.0", "base abc1234": "31.0"}, "old note"), "",
    _table("gpt-bench-w2 on CPU — 2026-11-22, torch 2.13.0", {"muon": "200.0"}, "wide"), "",
    "## Compile", "", "`python benchmarks/compile.py`", "",
    "| date | machine | torch | workload | wall | CPU | note |", "|---|---|---|---|---|---|---|",
    "| 2026-11-26 | 2-core CPU (x86_64) | torch 2.13.0+cpu | 20 name rules × 10000 tensors | 210 ms | 210 ms | a |",
    "| 2026-11-26 | 2-core CPU (x86_64) | torch 2.13.0+cpu | muon.yaml (roles traced) × 10002-tensor nn.Module "
    "| 562 ms | 562 ms | b |", ""])


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"(?m)^## ", text)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_a_new_run_replaces_its_configurations_record_in_place(results, tmp_path):
    log = tmp_path / "RESULTS.md"
    log.write_text(LOG_TEXT, encoding="utf-8")
    new = _table("gpt-bench on CPU — 2026-12-06, torch 2.13.0", {"muon": "25.0", "base def5678": "26.0"}, "new note")
    results.record("Step", new, log)
    text = log.read_text(encoding="utf-8")
    step = _sections(text)["Step (`benchmarks/step.py`)"]
    assert "2026-12-06" in step and "| muon | 25.0 |" in step and "new note" in step
    assert "2026-11-22, torch 2.13.0\n\n| optimizer" not in step.split("gpt-bench-w2")[0]  # the old one is gone
    assert "old note" not in text and "| muon | 30.0 |" not in text
    assert step.index("gpt-bench on CPU") < step.index("gpt-bench-w2")  # in its place, not appended
    assert text.replace(step, "") == LOG_TEXT.replace(_sections(LOG_TEXT)["Step (`benchmarks/step.py`)"], "")


def test_another_configuration_goes_at_its_sections_end_and_a_new_section_at_the_files(results, tmp_path):
    log = tmp_path / "RESULTS.md"
    log.write_text(LOG_TEXT, encoding="utf-8")
    other = _table("gpt-bench on CPU — 2026-12-06, torch 2.13.0", {"muon": "25.0", "sign-descent": "2.0"}, "more rows")
    two = other.replace("gpt-bench on", "gpt-bench-x2 on") + "\n\n" + _table("gpt-bench-x4 on CPU", {"muon": "1"}, "x4")
    results.record("Step", two, log)
    results.record("Memory", _table("memory on CPU — 2026-12-06, torch 2.13.0", {"muon": "1.0"}, "held"), log)
    text = log.read_text(encoding="utf-8")
    sections = _sections(text)
    step = sections["Step (`benchmarks/step.py`)"]
    assert "old note" in step and "wide" in step  # other configurations stay
    assert step.index("gpt-bench-w2") < step.index("gpt-bench-x2") < step.index("gpt-bench-x4")
    assert list(sections) == ["Step (`benchmarks/step.py`)", "Compile", "Memory"]
    assert sections["Memory"].startswith("Memory\n\n### memory on CPU")


def test_a_record_without_its_heading_is_refused(results, tmp_path):
    log = tmp_path / "RESULTS.md"
    log.write_text(LOG_TEXT, encoding="utf-8")
    with pytest.raises(ValueError, match="heading"):
        results.record("Step", "| a | b |", log)
    assert log.read_text(encoding="utf-8") == LOG_TEXT


def test_a_dated_row_replaces_its_workloads_row(results, tmp_path):
    log = tmp_path / "RESULTS.md"
    log.write_text(LOG_TEXT, encoding="utf-8")
    row = "| 2026-12-06 | 2-core CPU (x86_64) | torch 2.14.0+cpu | 20 name rules × 10000 tensors | 99 ms | 98 ms | c |"
    results.record_row("Compile", [], row, results.workload_key, log)
    module = ("| 2026-12-06 | 2-core CPU (x86_64) | torch 2.14.0+cpu | muon.yaml (roles from the module tree) × "
              "10002-tensor nn.Module | 400 ms | 400 ms | e |")
    results.record_row("Compile", [], module, results.workload_key, log)
    other = ("| 2026-12-06 | 16-core CPU (x86_64) | torch 2.14.0+cpu | 20 name rules × 10000 tensors "
             "| 50 ms | 50 ms | d |")
    smaller = "| 2026-12-06 | 2-core CPU (x86_64) | torch 2.14.0+cpu | 20 name rules × 1000 tensors | 9 ms | 9 ms | f |"
    for r in (other, smaller):
        results.record_row("Compile", [], r, results.workload_key, log)
    table = [line for line in _sections(log.read_text(encoding="utf-8"))["Compile"].splitlines()
             if line.startswith("| 2")]
    assert table == [row, module, other, smaller]  # in place; another machine's and another size's rows added
    results.record_row("QK", ["intro", "", "| date | machine |", "|---|---|"], row, results.workload_key, log)
    assert log.read_text(encoding="utf-8").endswith("## QK\n\nintro\n\n| date | machine |\n|---|---|\n" + row + "\n")


def test_the_log_holds_one_record_per_configuration_with_its_command(results):
    text = LOG.read_text(encoding="utf-8")
    sections = _sections(text)
    assert len(sections) >= 20 and len(set(sections)) == len(sections)
    for title, body in sections.items():
        assert re.search(r"(benchmarks|scripts)/\w+\.py", body), f"## {title} names no command"
        lines = body.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("### ")]
        keys = [results.config_key(lines[i:next((j for j in starts if j > i), len(lines))]) for i in starts]
        assert len(set(keys)) == len(keys), f"## {title} holds two records of one configuration"
        for i in starts:
            assert re.search(r"\d{4}-\d{2}-\d{2}", lines[i]) and "torch" in lines[i], lines[i]
        rows = [line for line in lines if line.startswith("| 20")]  # a dated table: one row per workload
        assert len({results.workload_key(r) for r in rows}) == len(rows), f"## {title}: {rows}"
