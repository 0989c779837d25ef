"""``benchmarks/distributed.py --layouts``: every layout of the layout matrix (gloo, CPU) side by side.

Per layout (one process, DDP ×2, FSDP2 ×2, HSDP 2×2, FSDP2 × TP 2×2 on 4 processes, HSDP × TP
2×2×2 on 8: tests/layout_worker.py builds them) and spec, an HF Llama (random init from a config)
takes one forward / backward and then ``--iters`` optimizer steps on those gradients. Reported per rank, medians:

* ``sent / param bytes``: what the rank hands to collectives during one ``opt.step()`` (counted
  at torch's dispatcher, c10d and functional collectives alike, so DTensor's own reductions
  count), divided by the model's parameter bytes. Per collective: ring all-reduce 2(w−1)/w·n,
  all-gather (w−1)·n, reduce-scatter (w−1)/w·n, all-to-all what leaves the rank, broadcast n
  from the root; n the input's bytes, w the group's size. FSDP2's and DDP's own traffic in
  forward / backward is not the optimizer's and is not counted.
* ``step (ms)``: the step's time, steps timed without the counter.

``--base COMMIT`` also steps that commit's package where it serves the layout (one process, DDP,
1-D FSDP2), round robin with this tree's on the same model and gradients (a before / after of the
step); it records only the table, not the JSON.

Then the layout matrix of tests/layout_worker.py (every shipped spec and the locality / stage
specs, 2 steps) gives each layout's largest deviation from one process,
max over tensors of ‖X − X₁‖_F / ‖X₁‖_F.
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = ROOT / "benchmarks" / "results" / "layouts.json"
DEFAULT_SPECS = ["muon", "adamw-hybrid", "spectral-clip", "normuon"]
#: the layout matrix's workers (tests/): script, processes
MATRIX = (("layout_worker.py", 4), ("layout_worker.py", 8), ("ep_worker.py", 4), ("pp_worker.py", 4))


def sent_bytes(func, args, kwargs) -> float:
    """Bytes this rank sends in one collective (see the module docstring), 0 for anything else."""
    name = func.__name__.split(".")[0]
    ns = func.namespace
    if ns not in ("c10d", "_c10d_functional"):
        return 0.0

    def size(t) -> float:
        ts = t if isinstance(t, (list, tuple)) else [t]
        return float(sum(x.numel() * x.element_size() for x in ts if isinstance(x, torch.Tensor)))

    def group(obj):
        if isinstance(obj, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            obj = _resolve_process_group(obj)
        elif isinstance(obj, torch.ScriptObject):  # c10d ops carry the group boxed
            obj = torch.distributed.ProcessGroup.unbox(obj)
        return obj.size(), obj.rank()

    if ns == "c10d":
        if name == "allreduce_":
            w, _ = group(args[1])
            return 2 * (w - 1) / w * size(args[0])
        if name in ("allgather_", "_allgather_base_"):
            w, _ = group(args[2])
            return (w - 1) * size(args[1])
        if name in ("reduce_scatter_", "_reduce_scatter_base_"):
            w, _ = group(args[2])
            return (w - 1) / w * size(args[1])
        if name == "alltoall_base_":
            w, r = group(args[2])
            return _all_to_all(args[1], args[4], w, r)
        if name == "broadcast_":
            w, r = group(args[1])
            return size(args[0]) if r == args[2] else 0.0
        return 0.0
    if name == "all_reduce":
        w, _ = group(args[2])
        return 2 * (w - 1) / w * size(args[0])
    if name == "all_gather_into_tensor":
        w, _ = group(args[2])
        return (w - 1) * size(args[0])
    if name == "reduce_scatter_tensor":
        w, _ = group(args[3])
        return (w - 1) / w * size(args[0])
    if name == "all_to_all_single":
        w, r = group(args[3])
        return _all_to_all(args[0], args[2], w, r)
    return 0.0


def _all_to_all(x: torch.Tensor, splits, w: int, r: int) -> float:
    total = float(x.numel() * x.element_size())
    if not splits:
        return total * (w - 1) / w
    row = total / max(sum(splits), 1)
    return total - splits[r] * row


def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sent = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.sent += sent_bytes(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    return Counter()


def worker(args) -> None:
    import torch.distributed as dist

    import layout_worker as lw
    from geomopt import GeomOptimizer

    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    world = lw.World()
    cfg = dict(lw.CFG, hidden_size=args.width, intermediate_size=2 * args.width, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=4 * args.width)
    base = None
    if args.base:  # the --base commit's package, for the layouts it serves (one process, DDP, 1-D FSDP2)
        from ab import import_base

        base = import_base(args.base, Path(tempfile.mkdtemp(prefix="geomopt-base-")))
    out: dict = {}
    for layout in ("single", *world.layouts) if world.size == 4 else world.layouts:
        for spec in args.spec:
            model = lw.make_model(cfg=cfg)
            if layout == "single":
                forward, kw = model, dict(distributed=False)
            else:
                model, forward, kw = world.wrap(layout, model)
            opts = {"this tree": GeomOptimizer(model, spec, **kw)}
            if base is not None and layout in ("single", "ddp", "fsdp"):
                opts[f"base {args.base}"] = base.GeomOptimizer(model, spec, **kw)
            ids = torch.randint(0, cfg["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
            forward(input_ids=ids, labels=ids).loss.backward()
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor: whole
            times: dict = {name: [] for name in opts}
            for i in range(args.warmup + args.iters):  # round robin: the machine's drift hits both alike
                for name, opt in opts.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    opt.step()
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
            for name, opt in opts.items():
                counter = _counter()
                dist.barrier()
                with counter:
                    opt.step()
                row = dict(step_ms=1e3 * statistics.median(times[name]), sent=counter.sent / param_bytes)
                rows: list = [None] * dist.get_world_size()
                dist.all_gather_object(rows, row)
                key = layout if name == "this tree" else f"{layout} ({name})"
                out.setdefault(key, {})[spec] = rows
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(dict(cost=out, param_mb=param_bytes / 2**20)))
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(script: Path, *argv: str, threads: int, nproc: int = 4) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script),
           *argv]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def deviations(threads: int) -> dict:
    """The layout matrix (:data:`MATRIX`): per layout, the largest deviation from one process over
    every spec it ran (the ranks' gathered parameters merged: a pipeline stage holds its part),
    the spec it occurs at, the processes, and per spec the bytes sent in a step, largest over ranks."""
    out = {}
    for script, nproc in MATRIX:
        with tempfile.TemporaryDirectory() as tmp:
            _torchrun(ROOT / "tests" / script, tmp, threads=threads, nproc=nproc)
            ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
        for layout in ranks[0]["sent"]:
            key = ranks[0].get("ref_key", {}).get(layout, "ref")  # a layout on another model has its own
            ref = {name: v["params"] for r in ranks for name, v in r[key].items()}
            got: dict = {}
            for r in ranks:
                for name, params in r.get(layout, {}).items():
                    got.setdefault(name, {}).update(params)
            worst = max((max(float((g[k] - ref[name][k]).norm() / ref[name][k].norm().clamp_min(1e-30)) for k in g),
                         name) for name, g in got.items())
            sent = {name: max(r["sent"][layout][name] for r in ranks) for name in ranks[0]["sent"][layout]}
            out[layout] = dict(max_rel=worst[0], spec=worst[1], specs=len(got), processes=nproc, sent=sent,
                               placements=ranks[0]["placements"][layout])
    return out


def main(args) -> int:
    if args.worker:
        worker(args)
        return 0
    from _results import emit

    from geomopt.cli.bench import device_name

    args.spec = args.spec or DEFAULT_SPECS
    cost: dict = {"cost": {}}
    for nproc in (4, 8):  # the 1-D and 2-D layouts, then HSDP × TP
        if nproc == 8 and args.base:  # --base: the layouts the base commit serves
            break
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            argv = ["--layouts", "--worker", "--out", str(out), "--width", str(args.width), "--threads",
                    str(args.threads), "--iters", str(args.iters), "--warmup", str(args.warmup)]
            argv += ["--base", args.base] if args.base else []
            _torchrun(ROOT / "benchmarks" / "distributed.py", *argv, *(a for s in args.spec for a in ("--spec", s)),
                      threads=args.threads, nproc=nproc)
            part = json.loads(out.read_text())
        cost["cost"].update(part["cost"])
        cost["param_mb"] = part["param_mb"]
    dev = {} if args.base else deviations(args.threads)  # --base: the step-time comparison only
    from geomopt.cli.demo import machine, source_version

    m = dict(machine("cpu"), threads=args.threads)
    record = dict(command="python benchmarks/distributed.py --layouts", date=datetime.date.today().isoformat(),
                  torch=torch.__version__, threads=args.threads, machine=m, source=source_version(ROOT),
                  width=args.width, param_mb=cost["param_mb"], cost=cost["cost"], deviation=dev)
    lines = [f"### Layouts on 4 and 8 gloo processes ({device_name('cpu')}, 2 cores shared) — {record['date']}, torch "
             f"{record['torch']}, {args.threads} thread(s) per rank",
             "", f"HF Llama width {args.width}, {cost['param_mb']:.1f} MiB of float32 parameters; per rank: bytes "
             f"sent in one optimizer step / parameter bytes, step time (median ms, min–max over ranks).", "",
             "| spec | " + " | ".join(cost["cost"]) + " |", "|---|" + "---|" * len(cost["cost"])]
    for spec in args.spec:
        cells = []
        for by_spec in cost["cost"].values():
            rows = by_spec[spec]
            sent = max(r["sent"] for r in rows)
            ms = [r["step_ms"] for r in rows]
            cells.append(f"{sent:.2f}× · {min(ms):.0f}–{max(ms):.0f} ms")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    if dev:
        head = "| layout | processes | largest deviation from one process | at spec | specs | "
        lines += ["", head + " | ".join(f"{s} sent" for s in args.spec) + " |",
                  "|---|---|---|---|---|" + "---|" * len(args.spec)]
        for layout, d in dev.items():
            sent = " | ".join(f"{d['sent'][s]:.2f}×" if s in d["sent"] else "—" for s in args.spec)
            lines.append(f"| {layout} | {d['processes']} | {d['max_rel']:.1e} | {d['spec']} | {d['specs']} | {sent} |")
    emit("\n".join(lines), args.record, "Layouts")
    if args.record and not args.base:
        RESULTS.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0
