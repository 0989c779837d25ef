"""The paper-reproduction examples run for real (``--quick``), write sane JSON and PNG files to
``--out`` (record mode too: repeated timings, the machine); the README's trainer integrations
(Hugging Face Trainer, Lightning) run two real steps."""

from __future__ import annotations

import importlib.util
import json
import os
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import geomopt

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
PNG = b"\x89PNG\r\n\x1a\n"


def _run(script: str, tmp_path: Path, *extra: str, probe: bool = False) -> dict:
    """Run an example with --quick; ``probe``: without OMP_NUM_THREADS, so that it probes its thread count."""
    env = {k: v for k, v in os.environ.items() if not (probe and k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--quick", "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    stem = script.removesuffix(".py")
    record = json.loads((tmp_path / f"{stem}.json").read_text())
    choice = record["thread_choice"]  # how the thread count was chosen, and the run header saying it
    assert choice["threads"] == record["threads"] and choice["how"] == ("probe" if probe else "OMP_NUM_THREADS")
    assert f"torch threads: {record['threads']} of" in proc.stdout and "load average" in proc.stdout
    assert ("the fastest on a probe" in proc.stdout) is probe and bool(choice["probe_ms"]) is probe
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == PNG
    assert record["command"].startswith(f"python examples/{script} --quick")
    assert record["torch"] == torch.__version__ and record["date"] and record["seconds_total"] > 0
    assert record["settings"]["quick"] is True and "out" not in record["settings"]
    machine = record["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["threads"] == record["threads"]
    assert machine["torch"] == torch.__version__
    return record


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(key: str, folder: Path) -> str:
    """What scripts/readme_tables.py makes of the record in ``folder`` for the README's ``key``."""
    tables = _readme_tables()
    return tables.RENDERERS[key](tables.Records(folder, committed=False))


def test_grokking_quick(tmp_path):
    rec = _run("grokking.py", tmp_path)
    summary, runs = rec["results"]["summary"], rec["results"]["runs"]
    assert list(summary) == ["AdamW", "uScion", "uScion + spectral clip"]
    assert summary["uScion"]["spec"] == "specs/examples/grokking-uscion.yaml"
    cap = rec["settings"]["max_epochs"]
    assert rec["results"]["complete"] is True and rec["threads"] == 1
    for r in runs:
        assert 1 <= r["epochs_to_target"] <= cap
        assert all(0.0 <= acc <= 1.0 for _, tr, va in r["curve"] for acc in (tr, va))
        assert r["seconds"] > 0
        # a run stops at the first epoch that reaches the target; one that never does counts as the cap
        vals = [va for _, _, va in r["curve"]]
        if r["reached"]:
            assert len(vals) == r["epochs_to_target"] and vals[-1] >= rec["settings"]["target"] > max(vals[:-1], default=-1)
        else:
            assert len(vals) == cap == r["epochs_to_target"] and max(vals) < rec["settings"]["target"]
    for name, s in summary.items():
        assert s["epochs"] == [r["epochs_to_target"] for r in runs if r["optimizer"] == name]
        assert s["median_epochs"] == sorted(s["epochs"])[len(s["epochs"]) // 2] and s["runs"] == len(s["seeds"]) == 1


def test_grokking_stops_at_the_target(tmp_path):
    # every run reaches a target of 0 after its first epoch and must stop there
    rec = _run("grokking.py", tmp_path, "--target", "0", "--seeds", "2", "--optimizers", "AdamW,uScion + spectral clip")
    summary, runs = rec["results"]["summary"], rec["results"]["runs"]
    assert [(r["optimizer"], r["seed"]) for r in runs] == [("AdamW", 0), ("uScion + spectral clip", 0),
                                                           ("AdamW", 1), ("uScion + spectral clip", 1)]
    assert all(r["reached"] and r["epochs_to_target"] == 1 and len(r["curve"]) == 1 for r in runs)
    assert {n: (s["epochs"], s["median_epochs"], s["reached"]) for n, s in summary.items()} == {
        "AdamW": ([1, 1], 1, 2), "uScion + spectral clip": ([1, 1], 1, 2)}


def test_digits_cnn_quick(tmp_path):
    rec = _run("digits_cnn.py", tmp_path, probe=True)
    summary = rec["results"]["summary"]
    assert len(summary) == 4
    for name, s in summary.items():
        assert len(s["test_acc"]) == 1
        assert 0.0 <= s["mean"] <= 1.0 and s["std"] == 0.0, (name, s)
    for r in rec["results"]["runs"]:
        assert r["curve"] and all(0.0 <= tr <= 1.0 and 0.0 <= te <= 1.0 for _, tr, te in r["curve"])
    table = _render("digits_cnn", tmp_path)
    assert "| uScion | `examples/digits-uscion.yaml` |" in table and "Time per seed: one run, on " in table


def test_char_gpt_quick(tmp_path):
    rec = _run("char_gpt.py", tmp_path, "--no-progress")
    summary, runs = rec["results"]["summary"], rec["results"]["runs"]
    assert list(summary) == ["uScion", "prox Frobenius 0.5ρ", "prox Frobenius 4ρ"]
    assert rec["settings"]["record"] is False and rec["settings"]["repeats"] == 1
    for r in runs:
        assert all(0 < v < math.log(256) + 0.5 for v in r["val"])
        assert r["norms"] and len(r["seconds_runs"]) == 1
    assert all(len(s["seconds_per_run"]) == 1 for s in summary.values())
    # the proximal Frobenius step keeps every hidden matrix in its ball (radius 0.5ρ, float tolerance)
    prox = next(r for r in runs if r["optimizer"] == "prox Frobenius 0.5ρ")
    assert all(v["fro_over_rho"] <= 0.5 * 1.001 for v in prox["norms"].values())



def test_learned_metric_quick(tmp_path):
    """SOAP, Muon and AdamW from the same seeds: each seed's runs start from the same weights and
    batches (equal first training loss), the record holds every seed, and the docs' table renders."""
    rec = _run("learned_metric.py", tmp_path, "--no-progress", "--seeds", "2")
    summary, runs = rec["results"]["summary"], rec["results"]["runs"]
    assert list(summary) == ["SOAP", "Muon", "AdamW"]
    assert summary["SOAP"]["spec"] == "specs/examples/soap-gpt.yaml"
    assert all(len(s["final_val"]) == 2 and s["std_final_val"] >= 0 for s in summary.values())
    for seed in (0, 1):
        first = {r["train"][0] for r in runs if r["seed"] == seed}
        assert len(first) == 1, first
    assert all(all(0 < v < math.log(256) + 0.5 for v in r["val"]) for r in runs)
    table = _render("learned_metric", tmp_path)
    assert "| SOAP | `examples/soap-gpt.yaml` |" in table and "2 seeds" in table


def test_moe_quick_in_record_mode(tmp_path):
    # record mode into a temporary --out: every training timed twice, the machine recorded. Context
    # 16 and batch 8 (default 64 and 32): 16× fewer tokens per training step, 4× fewer per
    # evaluation; the widths and expert count, which the routing rows check, stay the defaults
    rec = _run("moe.py", tmp_path, "--no-progress", "--record", "--repeats", "2", "--block", "16", "--batch", "8")
    summary, runs = rec["results"]["summary"], rec["results"]["runs"]
    assert list(summary) == ["muon.yaml", "AdamW"] and [r["optimizer"] for r in runs] == list(summary)
    assert rec["settings"]["record"] is True and rec["settings"]["repeats"] == 2
    assert rec["repeats_identical"] is True  # same seed, same batches: the repeats train identically
    for r in runs:
        assert len(r["val"]) == rec["settings"]["steps"] == 8
        assert all(math.isfinite(v) and 0 < v < math.log(256) + 1.0 for v in r["val"] + r["train"])
        assert len(r["seconds_runs"]) == 2 and all(t > 0 for t in r["seconds_runs"])
        assert summary[r["optimizer"]]["seconds_runs"] == r["seconds_runs"]
    assert rec["settings"]["ns_dtype_used"] == "float32"  # muon.yaml's dtype auto on CPU
    # both optimizers start from the same weights and see the same batches: equal first training loss
    assert runs[0]["train"][0] == runs[1]["train"][0]
    rows = {r["parameter"]: r for r in rec["routing"]}
    layer = "model.layers.0."
    assert all(n.startswith(layer) or ".layers." not in n for n in rows)
    experts = [r for n, r in rows.items() if ".experts." in n]
    assert {r["parameter"].rsplit(".", 1)[-1] for r in experts} == {"gate_up_proj", "down_proj"}
    for r in experts:  # batched (E, out, in): one matrix per expert (gate_up_proj: per gate/up half)
        assert (r["role"], r["rule"], r["geometry"]) == ("expert", "hidden", "spectral"), r
    assert rows[layer + "mlp.experts.down_proj"]["view"] == "4 × 64×128"
    assert rows[layer + "mlp.experts.gate_up_proj"]["view"] == "8 × 128×64"
    router = rows[layer + "mlp.gate.weight"]
    assert router["role"] == "router" and router["geometry"] != "spectral" and router["view"] == "-"
    assert rows[layer + "self_attn.q_proj.weight"]["role"] == "hidden"
    assert rows["lm_head.weight"]["role"] == "head" and rows["model.embed_tokens.weight"]["role"] == "embedding"
    # scripts/readme_tables.py renders the README's tables from such a record: times as min–max with the machine
    routing = _render("moe-routing", tmp_path)
    assert "| `model.layers.0.mlp.experts.down_proj` | 4×64×128 | expert | hidden | spectral | 4 × 64×128 |" in routing
    table = _render("moe", tmp_path)
    assert f"| {summary['AdamW']['final_val']:.3f} |" in table
    assert "min–max over 2 runs of each optimizer's training" in table and rec["machine"]["cpu"] in table


def test_example_specs_lint_clean_except_the_intended_heuristic():
    from geomopt.lint import lint_spec

    paths = sorted((SPECS / "examples").glob("*.yaml"))
    assert len(paths) == 9
    for path in paths:
        spec = geomopt.load_spec(path)
        errors = [d for d in lint_spec(spec) if d.severity == "error"]
        assert not errors, (path.name, errors)


def _gpt2_tiny():
    import transformers  # a test dependency
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers, transformers.GPT2LMHeadModel(cfg)


class _TokenData(torch.utils.data.Dataset):
    def __init__(self, n=16, t=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_hf_trainer_two_steps(tmp_path):
    transformers, model = _gpt2_tiny()
    opt = geomopt.GeomOptimizer(model, SPECS / "uscion.yaml")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_TokenData(), optimizers=(opt, sched))
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "transformer.h.0.attn.c_attn.weight" in moved and "transformer.wte.weight" in moved
    assert opt.param_groups[0]["lr"] < opt.param_groups[0]["initial_lr"]  # the scheduler stepped


def test_lightning_configure_optimizers_two_steps(tmp_path):
    import lightning as L

    from geomopt.models import GPT, GPTConfig

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))

        def training_step(self, batch, batch_idx):
            _, loss = self.model(batch["input_ids"], batch["labels"])
            return loss

        def configure_optimizers(self):
            opt = geomopt.GeomOptimizer(self.model, SPECS / "spectral-clip.yaml")
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Shifted(_TokenData):
        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": torch.roll(self.x[i], -1)}

    lit = LitGPT()
    before = lit.model.transformer.h[0].attn.c_attn.weight.detach().clone()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(lit, torch.utils.data.DataLoader(Shifted(), batch_size=4))
    assert trainer.global_step == 2
    assert not torch.equal(before, lit.model.transformer.h[0].attn.c_attn.weight.detach())
