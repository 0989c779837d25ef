"""Distributed steps: per-rank orthogonalization time with 1 vs 2 ranks (DDP), and, with
``--layouts``, every layout of a 4-process world side by side.

    python benchmarks/distributed.py [--model gpt-bench] [--spec specs/muon.yaml …] [--ranks 1 2]
                                     [--device cpu|cuda] [--record NOTE]
    python benchmarks/distributed.py --layouts [--width 256] [--spec muon …] [--base COMMIT] [--record NOTE]

Launches ``torchrun --nproc_per_node N`` on itself for each N (gloo on CPU, nccl on CUDA). Every
rank steps a GeomOptimizer over the model's hidden matrices (fixed random gradients) and reports
the median step time and the time its share of the matrix functions took (``opt.work``: host
time, so on CUDA it synchronizes before and after each step). With --record, the table replaces its
configuration's record in benchmarks/RESULTS.md.

``--layouts`` (4 gloo processes on CPU: :mod:`_layouts`) steps an HF Llama under one process,
DDP ×2, FSDP2 ×2, HSDP 2×2 and FSDP2 × TP 2×2 and reports, per layout and spec, the bytes each
rank sends in the optimizer's step (relative to the model's parameter bytes) and the step's
time; then it runs the layout matrix of tests/layout_worker.py (every shipped spec) and reports
each layout's largest deviation from one process. With --record it also writes
benchmarks/results/layouts.json, which the README's table is generated from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch.distributed as dist

    from geomopt import GeomOptimizer
    from geomopt.cli.bench import hidden_matrices

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    out = {}
    for spec in args.spec:
        named = hidden_matrices(args.model, device, torch.float32)
        gen = torch.Generator().manual_seed(1)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt = GeomOptimizer(named, spec)
        steps, ortho = [], []
        for i in range(args.warmup + args.iters):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            before = opt.work.seconds
            t0 = time.perf_counter()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                steps.append(time.perf_counter() - t0)
                ortho.append(opt.work.seconds - before)
        row = dict(step_ms=1e3 * statistics.median(steps), ortho_ms=1e3 * statistics.median(ortho),
                   matrices=opt.work.rows / (args.warmup + args.iters))
        rows = [None] * world
        dist.all_gather_object(rows, row)
        out[Path(spec).stem] = rows
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def launch(args, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), __file__, "--worker", "--out", str(out), "--model",
               args.model, "--device", args.device, "--threads", str(args.threads), "--iters", str(args.iters),
               "--warmup", str(args.warmup)] + [a for s in args.spec for a in ("--spec", s)]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--spec", action="append")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--record", metavar="NOTE")
    p.add_argument("--layouts", action="store_true", help="every 4-process layout (see the docstring)")
    p.add_argument("--width", type=int, default=256, help="--layouts: the Llama's width (default 256)")
    p.add_argument("--base", metavar="COMMIT", help="--layouts: also time this commit's package (before / after)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layouts:
        import _layouts

        return _layouts.main(args)
    args.spec = args.spec or [str(ROOT / "specs" / "muon.yaml"), str(ROOT / "specs" / "spectral-clip.yaml")]
    if args.worker:
        worker(args)
        return 0
    results = {n: launch(args, n) for n in args.ranks}
    from geomopt.cli.bench import device_name

    lines = [f"### {args.model}, DDP on {device_name(args.device)} — {datetime.date.today().isoformat()}, torch "
             f"{torch.__version__}, {args.threads} thread(s) per rank",
             "", "| spec | ranks | rank | matrices / step | orthogonalization (ms) | step (ms) |",
             "|---|---|---|---|---|---|"]
    for spec in (Path(s).stem for s in args.spec):
        for n, res in results.items():
            for r, row in enumerate(res[spec]):
                lines.append(f"| {spec} | {n} | {r} | {row['matrices']:.0f} | {row['ortho_ms']:.2f} | {row['step_ms']:.2f} |")
    emit("\n".join(lines), args.record, section_for(args.device, "DDP"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
