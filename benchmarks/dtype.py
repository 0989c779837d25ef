"""The Newton–Schulz dtype where a step runs: matmul throughput in float32 and bfloat16 on this
device, and a muon.yaml step with its approx dtype ``auto`` (what the shipped spec says: bf16 on
CUDA, float32 on CPU) against a forced ``bfloat16``, with torch.optim.Muon (always bf16) and fused
AdamW on the same tensors for scale.

    python benchmarks/dtype.py [--model gpt-bench] [--device cpu] [--record NOTE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name, hidden_workload  # noqa: E402
from geomopt.geometry.dtypes import BF16Warning, native_bf16_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def gflops(n: int, dtype: torch.dtype, device: str, reps: int) -> float:
    """Throughput of an n×n×n matmul (2n³ flops), median of ``reps``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    timer = Timer(device)
    times = timer(lambda: a @ b, 1, reps)
    return 2 * n ** 3 / (statistics.median(times) / 1e3) / 1e9  # Timer gives ms


def muon_spec(dtype: str) -> dict:
    spec = geomopt.load_spec(ROOT / "specs" / "muon.yaml").model_dump()
    for rule in spec["rules"]:
        if (rule["geometry"].get("approx") or {}).get("kind") == "newton_schulz":
            rule["geometry"]["approx"]["dtype"] = dtype
    return spec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", type=int, default=512, help="matmul size for the throughput rows")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    f32 = gflops(args.size, torch.float32, args.device, max(3, args.iters))
    bf16 = gflops(args.size, torch.bfloat16, args.device, max(1, args.iters // 3))
    _, fresh = hidden_workload(args.model, args.device, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)  # the forced row is the point of the table
        rows = [("torch.optim.Muon (bf16 Newton–Schulz)",
                 torch.optim.Muon([q for _, q in fresh()], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)),
                ("AdamW (fused)", torch.optim.AdamW([q for _, q in fresh()], lr=1e-3, fused=True)),
                ("muon.yaml, dtype auto (shipped)", geomopt.GeomOptimizer(fresh(), muon_spec("auto"))),
                ("muon.yaml, dtype bfloat16 (forced)", geomopt.GeomOptimizer(fresh(), muon_spec("bfloat16")))]
    timer = Timer(args.device)
    times = {}
    for name, opt in rows:
        times[name] = timer(opt.step, 1, args.iters)
    muon = statistics.median(times[rows[0][0]])
    adamw = statistics.median(times[rows[1][0]])
    native = "native" if args.device != "cpu" or native_bf16_cpu() else "emulated (no native bf16 on this CPU)"
    lines = [f"### Newton–Schulz dtype: {args.model} hidden matrices, {device_name(args.device)}, "
             f"torch {torch.__version__} — {datetime.date.today().isoformat()}", "",
             f"matmul {args.size}³: float32 {f32:.1f} GFLOP/s, bfloat16 {bf16:.1f} GFLOP/s ({native}); "
             f"ratio {f32 / bf16:.0f}×", "",
             "| optimizer | step (ms, median) | × torch Muon | × fused AdamW |", "|---|---|---|---|"]
    for name, _ in rows:
        ms = statistics.median(times[name])  # Timer gives ms
        lines.append(f"| {name} | {ms:.1f} | {ms / muon:.3f} | {ms / adamw:.1f} |")
    emit("\n".join(lines), args.record, section_for(args.device, "Newton–Schulz dtype"))
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(code)
