"""The benchmark scripts run end to end on a small model (CPU) and print their tables; nothing is
recorded (no --record)."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

import geomopt

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_backward_script_reports_speed_and_errors(capsys):
    assert _script("backward").main(["--batch", "2", "--shape", "12x8"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == 8  # 4 constraints × (near, far)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) < 1e-4 and float(cells[5]) < 1e-4, row  # both errors vs float64
        # the eigensolver floor: positive, and the ceiling is the SVD's time over it
        svd_ms, eigh_ms, ceiling = float(cells[1]), float(cells[6]), float(cells[7].rstrip("×"))
        assert eigh_ms > 0 and abs(ceiling - svd_ms / eigh_ms) <= 0.07 * ceiling + 0.1, row  # printed rounding


def test_svd_free_script_compares_three_variants(capsys):
    assert _script("svd_free").main(["--model", "gpt", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    for spec in ("stiefel", "spectral-clip"):
        labels = re.findall(rf"^\| {spec} \| (\w+) \|", out, flags=re.M)
        assert labels == ["none", "exact", "polar"], out


def test_profile_script_splits_host_and_completion(capsys):
    assert _script("profile_step").main(["--model", "gpt", "--rows", "5"]) == 0
    out = capsys.readouterr().out
    host, done = map(float, re.search(r"host ([\d.]+) ms to return, ([\d.]+) ms to completion", out).groups())
    assert host > 0 and done > 0
    assert "aten::" in out  # the operator table


@pytest.mark.parametrize("spec", ["muon", "sign-descent"])
def test_step_script_times_against_muon_and_adamw(spec, capsys):
    root = BENCH.parent
    assert _script("step").main(["--model", "gpt", "--iters", "2", "--spec", str(root / "specs" / f"{spec}.yaml")]) == 0
    out = capsys.readouterr().out
    names = re.findall(r"^\| ([^|]+?) \| [\d.]+ \|", out, flags=re.M)
    assert names == ["torch.optim.Muon", "AdamW (fused)", f"geomopt {spec}"], out


def test_ab_script_compares_this_tree_with_a_commit(capsys):
    assert _script("ab").main(["--base", "HEAD", "--model", "gpt", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    names = re.findall(r"^\| ([^|]+?) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, flags=re.M)
    assert names == ["torch.optim.Muon", "base HEAD", "this tree", "base HEAD, again"], out
    assert _script("ab").main(["--base", "HEAD", "--model", "gpt", "--iters", "1", "--no-torch"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^\| ([^|]+?) \| [\d.]+ \| – \| [\d.]+ \|$", out, flags=re.M) == [
        "base HEAD", "this tree", "base HEAD, again"], out


def test_experts_script_compares_the_batched_view_with_separate_tensors(capsys):
    assert _script("experts").main(["--experts", "3", "--shape", "12x8", "--tensors", "2", "--iters", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tensors" in line]
    assert len(rows) == 2, rows
    batched = [c.strip() for c in rows[0].strip("|").split("|")]
    assert "view batch: 1" in batched[0] and float(batched[1]) > 0
    assert float(batched[3]) == 0.0  # E matrices either way: the same bits


def test_dtype_script_times_the_shipped_auto_against_forced_bf16(capsys):
    assert _script("dtype").main(["--model", "gpt", "--iters", "1", "--size", "64"]) == 0
    out = capsys.readouterr().out
    f32, bf16 = map(float, re.search(r"float32 ([\d.]+) GFLOP/s, bfloat16 ([\d.]+) GFLOP/s", out).groups())
    assert f32 > 0 and bf16 > 0
    names = re.findall(r"^\| ([^|]+?) \| [\d.]+ \|", out, flags=re.M)
    assert names == ["torch.optim.Muon (bf16 Newton–Schulz)", "AdamW (fused)", "muon.yaml, dtype auto (shipped)",
                     "muon.yaml, dtype bfloat16 (forced)"], out


def test_lint_script_times_shipped_and_generated_specs(capsys):
    assert _script("lint").main(["--quick"]) == 0
    rows = re.findall(r"^\| (\S+) \| [\d.]+ kB \| (\d+) \| [\d.]+ \| [\d.]+ \| (yes|no) \|", capsys.readouterr().out, flags=re.M)
    assert [r[0] for r in rows] == ["specs/muon.yaml", "specs/muon.geom", "generated.yaml", "generated.geom"], rows
    assert all(int(r[1]) >= 4 for r in rows)
    assert [r[2] for r in rows] == ["no"] * 4  # lint without a model never imports torch


def test_memory_script_measures_held_bytes_against_torch(capsys):
    assert _script("memory").main(["--quick", "--specs", "muon", "sign-descent", "--state", "float32", "int8"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\S+)\.yaml \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out,
                      flags=re.M)
    assert [r[:2] for r in rows] == [("muon", "float32"), ("muon", "int8"), ("sign-descent", "float32"),
                                     ("sign-descent", "int8")], out
    ratios = {r[:2]: float(r[4]) for r in rows}
    assert ratios[("muon", "int8")] < 0.3 * ratios[("muon", "float32")], ratios  # codes + a scale per 256
    for row in rows:
        state, torch_state, ratio, workspace, largest = map(float, row[2:])
        assert state > 0 and torch_state > 0 and largest > 0, row
        assert abs(ratio - state / torch_state) <= 0.006 / torch_state, row  # the MiB columns have 2 decimals
        assert workspace <= largest, row  # the step's scratch: at most the largest bucket


def test_suite_script_times_the_test_command(capsys):
    assert _script("suite").main(["--", "tests/test_match.py", "-k", "module_rule or select_agrees"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\*\*this tree \(\w+.*\)\*\*: \d+ min \d+ s wall \(\d+ passed", out), out
    tests = re.findall(r"^\| [\d.]+ \| (call|setup|teardown) \| `(tests/test_match\.py::\S+)` \|$", out, flags=re.M)
    assert tests and all(t.startswith("tests/test_match.py::") for _, t in tests), out


def test_elementwise_script_times_specs_against_fused_adamw(capsys):
    assert _script("elementwise").main(["--widths", "64", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (.+?) \| [\d.]+ \| ([\d.]+) \|$", out, flags=re.M))
    assert float(rows["AdamW (fused)"]) == 1.0, out
    for name in ("geomopt examples/adam-all", "geomopt sign-descent", "geomopt normalized-sgd",
                 "check (geomopt's finiteness test alone)"):
        assert float(rows[name]) > 0, (name, out)


def test_stages_script_times_staged_variants_against_the_muon_spec(capsys):
    assert _script("stages").main(["--widths", "64", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (.+?) \| [\d.]+ \| ([\d.]+) \|$", out, flags=re.M))
    assert float(rows["muon"]) == 1.0, out
    for name in ("normuon", "adamuon", "muon + cautious", "muon + cautious decay"):
        assert float(rows[name]) > 0, (name, out)


def test_gram_ns_script_compares_the_two_iterations(capsys):
    assert _script("gram_ns").main(["--shapes", "16x64", "--batch", "2", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| 2 × 16×64 \|", out, flags=re.M), out


def test_turbo_ns_script_compares_muon_and_turbo_muon(capsys):
    assert _script("turbo_ns").main(["--shapes", "16x64", "--batch", "2", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\| 2 × 16×64 \| [\d.]+ \| [\d.]+ \| [\d.]+× \| ([\d.]+) \| ([\d.]+) \|$", out, flags=re.M)
    assert row, out
    assert 0 < float(row[1]) < 1 and 0 < float(row[2]) < 1, out


def test_ab_script_reads_a_base_commit_whose_specs_extend_shipped_ones(capsys):
    # the base's specs and grammar go inside its package, as a wheel installs them
    spec = str(Path(__file__).resolve().parents[1] / "specs" / "catalog" / "normuon.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _script("ab").main(["--base", "HEAD", "--model", "gpt", "--iters", "1", "--no-torch",
                                   "--spec", spec]) == 0
    # the copies' warnings come as classes another process can import by module name (pytest-xdist's
    # controller does, for its workers' warnings): the copy's class named in the text
    copies = [w for w in caught if str(w.message).startswith("RolesGuessedWarning: ")]
    assert len(copies) == 2, [str(w.message)[:80] for w in caught]  # base HEAD, base HEAD again
    assert all(w.category is UserWarning for w in copies)
    assert {w.category.__module__.split(".")[0] for w in caught} <= {"builtins", "geomopt"}
    out = capsys.readouterr().out
    assert re.findall(r"^\| ([^|]+?) \| [\d.]+ \| – \| [\d.]+ \|$", out, flags=re.M) == [
        "base HEAD", "this tree", "base HEAD, again"], out


def test_syncs_script_counts_what_reads_a_device_value_back(capsys):
    syncs = _script("syncs")
    with syncs.SyncCounter() as counter:
        t = torch.ones(3)
        _ = t.sum().item(), bool(t.all()), float(t[0])
        t.mul_(2)  # no read-back
    assert sum(counter.counts.values()) == 3, counter.counts
    assert syncs.main([]) == 0
    rows = re.findall(r"^\| ([\w-]+) \| (\d+) \|", capsys.readouterr().out, flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(geomopt.shipped_specs())
    assert all(int(n) >= 1 for _, n in rows)  # the finiteness test, at least


def test_state_update_error_script_finds_int8_coarser_than_bf16_rule_by_rule(tmp_path, capsys):
    script = _script("state_update_error")
    assert script.main(["--run", "char_gpt", "--steps", "30", "--out", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: tuple(map(float, r[1:8])) for r in re.findall(
        r"^\| (\w+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| [\d.—]+ \|$",
        out, flags=re.M)}
    assert set(rows) == {"embeddings", "head", "hidden", "rest"}, out
    for rule in ("embeddings", "head", "hidden"):  # every tensor's state quantized
        _, bf16, int8, ec, up_bf16, up_int8, up_ec = rows[rule]
        # one scale per 256 entries rounds coarser than bf16's exponent per entry, and so moves the update more;
        # int8-ec's corrections place each value within its code's bin, a 15th of int8's rounding at most
        assert 0 < bf16 < int8 < 0.05 and up_bf16 < up_int8, (rule, out)
        assert 0 < ec < int8 / 5 and up_ec < up_int8, (rule, out)
    # the second steps start from the same parameters but for float rounding, and the JSON has the table's rows
    start = float(re.search(r"differ by at most ([\d.e+-]+)", out).group(1))
    assert start <= 1e-5, out
    import json

    saved = json.loads((tmp_path / "e.json").read_text())
    assert {r["rule"] for r in saved["rows"]} == set(rows)
    assert all(0 <= r["update_int8"] <= 2 for r in saved["rows"]), saved


def test_state_quality_script_compares_precisions_and_a_mixed_spec(tmp_path, capsys):
    out_json = tmp_path / "q.json"
    assert _script("state_quality").main(["--run", "char_gpt", "--steps", "5", "--seeds", "0", "1",
                                          "--mixed", "hidden=bfloat16", "--out", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: (float(r[1]), float(r[2])) for r in re.findall(
        r"^\| ([^|]+?) \| [\d.]+ \| ([+-][\d.]+) ± [\d.]+ \| [+-][\d.]+ \| ([\d.]+) \|$", out, flags=re.M)}
    assert list(rows) == ["float32", "bfloat16", "int8", "int8-ec", "float32, lr × (1 + 1e-6) (control)",
                          "int8, hidden bfloat16"], out
    assert rows["float32"] == (0.0, 1.0), out
    # bf16 halves every moment; int8 keeps a byte and a 256th of a float32 scale, but small tensors stay float32
    assert abs(rows["bfloat16"][1] - 0.5) < 1e-3 and 0.25 < rows["int8"][1] < 0.3, out
    assert rows["int8"][1] < rows["int8, hidden bfloat16"][1] < rows["bfloat16"][1], out
    assert rows["int8"][1] < rows["int8-ec"][1] < 0.4, out  # half a byte more per quantized entry
    assert rows["float32, lr × (1 + 1e-6) (control)"][1] == 1.0, out
    import json

    runs = json.loads(out_json.read_text())["runs"]
    assert sorted({r["seed"] for r in runs}) == [0, 1] and len(runs) == 12


def test_state_cost_script_times_each_precision_against_float32_state_and_counts_its_bytes(capsys):
    assert _script("state_cost").main(["--model", "gpt", "--specs", "muon", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"^\| muon, ([\w-]+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out,
                       flags=re.M)
    codec = {r[0]: float(r[2]) for r in found}  # the codec alone over float32 state's step: none for float32
    assert codec["float32"] == 0 and all(codec[d] > 0 for d in ("bfloat16", "int8", "int8-ec")), out
    rows = {r[0]: (float(r[1]), float(r[3]), float(r[4])) for r in found}
    assert list(rows) == ["float32", "bfloat16", "int8", "int8-ec"], out
    assert rows["float32"] == (1.0, 4.0, 1.0), out  # every hidden matrix's momentum, 4 bytes an entry
    # int8-ec: int8's byte and a 256th of a scale, and half a byte of corrections
    assert rows["bfloat16"][1:] == (2.0, 0.5) and rows["int8"][2] < rows["int8-ec"][2] < 0.4, out
    assert rows["int8-ec"][1] == pytest.approx(1 + 0.5 + 4 / 256, abs=2e-3), out


def test_state_cost_parts_times_the_compiled_encoded_call_with_each_part_stood_in_for(monkeypatch):
    """--parts: fused AdamW first, then per precision the whole compiled call and one row per part
    replaced (cumulatively); the codec's own functions are back in place afterwards."""
    import sys

    from geomopt.optim.persist import state_codec

    script = _script("state_cost")
    monkeypatch.setitem(sys.modules, script.__name__, script)  # the compiler reads the stand-ins' module
    before = {k: getattr(state_codec, k) for names in script.STAND_INS.values() for k in names}
    rows = script.parts(iters=1, n=4 * 256)
    assert [(r["state"], r["call"]) for r in rows] == [
        ("float32", "torch fused AdamW"),
        ("int8", "whole"), ("int8", "− code search"), ("int8", "− block scales"), ("int8", "− decode"),
        ("int8-ec", "whole"), ("int8-ec", "− code search"), ("int8-ec", "− block scales"), ("int8-ec", "− decode"),
        ("bfloat16", "whole"), ("bfloat16", "− rounding")]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ns"] > 0 for r in rows)
    assert {k: getattr(state_codec, k) for k in before} == before


@pytest.mark.parametrize("signed", [True, False])
def test_the_codec_forms_closed_forms_give_the_maps_values_and_bucketizes_codes(signed):
    """codec_forms.py times closed forms against the codec's tables: they are the map bit for bit (all
    256 codes) and bucketize's codes on every midpoint ±3 ulp, a dense sample, random bit patterns and
    the specials (a midpoint itself takes the upper code); the search's guess is the code or the one
    below it, so one comparison finishes."""
    from geomopt.optim.persist.codes import dynamic_map

    script = _script("codec_forms")
    assert script.mismatches(signed) == (0, 0)
    q = dynamic_map(signed)
    mids = (q[1:] + q[:-1]) / 2
    assert torch.equal(script.search(mids, signed), torch.arange(1, 256, dtype=torch.int32))  # a tie: the upper
    guess = script._guess(script.samples(signed), signed)
    want = torch.bucketize(script.samples(signed), mids, right=True)
    assert bool(((want - guess >= 0) & (want - guess <= 1)).all())


def test_weight_quality_script_compares_weights_and_keeps_what_it_ran(tmp_path, capsys):
    """Each row against the float32-weights reference at the same seed, bytes per parameter by rule
    (a momentum rule with bf16 weights, int8 compensation and bf16 state: 2 + 1 + 2 = 5), and a
    second call runs only the rows the file lacks."""
    import json

    out_json = tmp_path / "w.json"
    argv = ["--run", "demo", "--steps", "3", "--seeds", "0", "--out", str(out_json)]
    assert _script("weight_quality").main([*argv, "--without", "int16", "control"]) == 0
    first = capsys.readouterr().out
    assert "int16" not in first and first.count("seed 0 ") == 4, first
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["float32 weights (autocast bf16)"]["diff_mean"] == 0.0
    assert rows["float32 weights (autocast bf16)"]["bytes_per_param"]["all"] == 8.0  # weights + momentum
    assert rows["bf16 weights, compensation int8, bf16 state"]["bytes_per_param"]["hidden"] == 5.0
    assert rows["bf16 weights, no compensation"]["bytes_per_param"]["all"] == 6.0
    assert _script("weight_quality").main(argv) == 0  # the two rows left out before, and only they
    second = capsys.readouterr().out
    assert second.count("seed 0 ") == 2 and "compensation int16: " in second and "(control): " in second, second
    assert len(json.loads(out_json.read_text())["rows"]) == 6


def test_busy_machine_script_times_the_demo_quiet_and_beside_a_busy_core(tmp_path, capsys):
    import json

    argv = ["--repeats", "1", "--only", "demo", "--steps", "2", "--out", str(tmp_path)]
    assert _script("busy_machine").main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| `geomopt demo --quick` \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, flags=re.M), out
    record = json.loads((tmp_path / "busy_machine.json").read_text())
    (row,) = record["rows"]
    assert row["quiet_s"] > 0 and row["busy_s"] > 0 and abs(row["ratio"] - row["busy_s"] / row["quiet_s"]) < 0.01
    assert len(row["load_before_quiet"]) == len(row["load_before_busy"]) == 1
    with pytest.raises(SystemExit):
        _script("busy_machine").main(["--only", "demo", "--record"])  # a record has every row


def test_kron_script_counts_the_state_each_optimizer_holds(capsys):
    """benchmarks/kron.py runs every row, and the state it reports for geomopt's Shampoo is the
    factors and roots, 2·(m² + n²) float32 entries per matrix, plus one int64 count (SOAP's and
    PSGD's: theirs)."""
    kron = _script("kron")
    assert kron.main(["--width", "8", "--layers", "1", "--every", "2", "--units", "1"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("torch.optim.Muon", "kronecker shampoo", "pytorch_optimizer.SOAP"))
    rows, _ = kron.measure(8, 1, 2, 1)
    held = {name.split(" (")[0].split(",")[0]: b for name, _, b in rows}  # both Shampoo roots hold the same
    want = sum(8 * (m * m + n * n) + 8 for m, n in kron.shapes(8, 1))
    assert held["geomopt kronecker shampoo"] == want
    assert held["geomopt kronecker soap"] == sum(8 * (m * m + n * n) + 8 * m * n + 8 for m, n in kron.shapes(8, 1))
    # PSGD: the factors Q_L, Q_R and the momentum, float32, plus the count
    assert held["geomopt kronecker psgd"] == sum(4 * (m * m + n * n) + 4 * m * n + 8 for m, n in kron.shapes(8, 1))
