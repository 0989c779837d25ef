"""`geomopt demo --quick` and `geomopt bench` run for real (tiny settings) and report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from geomopt.cli.demo import RESULTS_DIR, output_dir
from geomopt.cli.main import EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick_lints_plans_trains_and_plots(tmp_path, capsys):
    # record mode in its quickest form, into a temporary --out: each training timed twice, the machine recorded
    assert main(["demo", "--quick", "--steps", "10", "--record", "--repeats", "2", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "== lint" in text and "== plan" in text and "== training" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("spectral-clip", "AdamW"))}
    assert set(rows) == {"spectral-clip", "AdamW"}
    for cols in rows.values():
        final_val = float(cols[2])
        assert 0 < final_val < 5.545  # below ln(256), the loss of a uniform byte model
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["command"] == "geomopt demo --steps 10 --quick --record --repeats 2"
    assert [r["label"] for r in summary["results"]] == ["spectral-clip", "AdamW"]
    assert summary["results"][0]["final_val"] == round(float(rows["spectral-clip"][2]), 4)
    assert summary["record"] is True and summary["repeats"] == 2 and summary["repeats_identical"] is True
    assert all(len(r["seconds_runs"]) == 2 and min(r["seconds_runs"]) > 0 for r in summary["results"])
    machine = summary["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"] == torch.__version__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.png"]


def test_demo_writes_under_runs_by_default_and_the_committed_results_only_in_record_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_dir(None, False, "demo") == Path("runs") / "demo"
    assert output_dir(None, True, "demo") == RESULTS_DIR == ROOT / "examples" / "results"
    assert output_dir("elsewhere", True, "demo") == Path("elsewhere")
    for out in (RESULTS_DIR, RESULTS_DIR / "sub"):
        with pytest.raises(ValueError, match="--record"):
            output_dir(str(out), False, "demo")
    # refused before any training
    assert main(["demo", "--quick", "--no-progress", "--out", str(RESULTS_DIR)]) == EXIT_USAGE
    assert main(["demo", "--quick", "--no-progress", "--repeats", "0"]) == EXIT_USAGE
    assert main(["demo", "--quick", "--no-progress", "--out", "demo.png"]) == EXIT_USAGE  # a folder, not a file
    assert not (tmp_path / "runs").exists()


def test_bench_reports_ratios_against_muon_and_adamw(capsys):
    assert main(["bench", "--model", "gpt", "--iters", "2", "--warmup", "1"]) == 0
    text = capsys.readouterr().out
    rows = [l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| optimizer")]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == ["torch.optim.Muon", "AdamW (fused)", "geomopt muon"]
    ratio = float(rows[0].split("|")[3])
    assert ratio == 1.0
    assert all(float(r.split("|")[2]) > 0 for r in rows)
    assert re.search(r"hidden matrices", text)
