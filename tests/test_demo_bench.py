"""`geomopt demo --quick` and `geomopt bench` run for real (tiny settings) and report."""

from __future__ import annotations

import re

from geomopt.cli.main import main


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
