"""`geomopt demo --quick` and `geomopt bench` run for real (tiny settings) and report."""

from __future__ import annotations

import json
import re
from pathlib import Path

from geomopt.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick_lints_plans_trains_and_plots(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== lint" in text and "== plan" in text and "== training" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("spectral-clip", "AdamW"))}
    assert set(rows) == {"spectral-clip", "AdamW"}
    for cols in rows.values():
        final_val = float(cols[2])
        assert 0 < final_val < 5.545  # below ln(256), the loss of a uniform byte model
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(out.with_suffix(".json").read_text())
    assert [r["label"] for r in summary["results"]] == ["spectral-clip", "AdamW"]
    assert summary["results"][0]["final_val"] == round(float(rows["spectral-clip"][2]), 4)


def test_readme_quotes_the_demo_results():
    """The README's demo table is examples/results/demo.json (written by ``geomopt demo --out
    examples/results/demo.png``), not typed by hand."""
    summary = json.loads((ROOT / "examples" / "results" / "demo.json").read_text())
    readme = (ROOT / "README.md").read_text()
    spec, adamw = summary["results"]
    assert summary["command"] == "geomopt demo" and summary["steps"] == 800
    assert re.search(rf"\| spectral-clip \(uScion \+ spectral-ball clipping\) \| {spec['final_val']:.3f} \| "
                     rf"{spec['bits_per_byte']:.2f} \| {spec['seconds']:.0f} \|", readme)
    assert re.search(rf"\| AdamW \(lr 3e-3, betas \(0.9, 0.95\), wd 0.1\) \| {adamw['final_val']:.3f} \| "
                     rf"{adamw['bits_per_byte']:.2f} \| {adamw['seconds']:.0f} \|", readme)


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
