"""Where one optimizer step spends its time: host (Python, dispatch) against device (kernels).

    python benchmarks/profile_step.py [--model gpt-bench] [--spec specs/muon.yaml] [--device cpu|cuda]

Prints the host time of ``step()`` (time to return, no synchronization), the step's time to
completion, and torch.profiler's top operators by self device time (CUDA) or self CPU time. A
step whose host time is close to its completion time is launch-bound: fewer, larger kernels
(batching, CUDA graphs) are what helps, not faster kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import geomopt
from geomopt.cli.bench import Timer, device_name, hidden_matrices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--spec", default=str(Path(__file__).resolve().parents[1] / "specs" / "muon.yaml"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    params = hidden_matrices(args.model, args.device, torch.float32)
    gen = torch.Generator().manual_seed(1)
    for _, q in params:
        q.grad = (torch.randn(q.shape, generator=gen) * 1e-3).to(args.device)
    opt = geomopt.GeomOptimizer(params, args.spec)
    for _ in range(3):
        opt.step()
    host = []
    for _ in range(10):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
    done = Timer(args.device)(opt.step, 0, 10)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            opt.step()
        if cuda:
            torch.cuda.synchronize()
    print(f"{args.spec} on {args.model}, {device_name(args.device)}, torch {torch.__version__}")
    print(f"step(): host {statistics.median(host):.2f} ms to return, {statistics.median(done):.2f} ms to completion")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=48))
    return 0


if __name__ == "__main__":
    sys.exit(main())
