"""The whole step in one CUDA graph: ``capturable=True``, captured with ``torch.cuda.graph`` and
replayed, against torch.optim.Muon, the eager step and the per-bucket graphs (``cuda_graphs=True``).

    python benchmarks/capture.py [--model gpt2-small] [--spec specs/muon.yaml …] [--record NOTE]

For every spec (all shipped specs by default), on copies of the same hidden matrices with the same
fixed gradients: the capturable optimizer takes its first step (which creates the state), two
warm-up steps on a side stream, then one step captured in a CUDA graph. A twin with the default
step takes as many eager steps; after three replays the two must agree (the largest
‖X_graph − X_eager‖ / ‖X_eager‖ over the tensors is printed). Then every row is timed round-robin
with CUDA events (medians). Each spec runs in a process of its own; a spec whose capture is
refused (a decomposition inside: torch reads its error code on the host) or fails is reported with
the reason, not skipped.

``--lr-check`` also captures the muon spec with ``lr`` a 0-d device tensor, changes it between
replays (``lr.fill_``, as torch's LR schedulers do for tensor learning rates) and compares each
replay with an eager step at that lr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import GPU, emit  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name, hidden_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def captured(opt, warmup: int = 2):
    """The graph of one ``opt.step()`` after ``warmup`` steps on a side stream (CUDA's rule for
    capture: the allocator's and libraries' first uses happen outside it). The captured step is
    recorded, not run: after this, ``opt`` has taken ``warmup`` steps more."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def deviation(a, b) -> float:
    return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for (_, x), (_, y) in zip(a, b))


def stage(name: str) -> None:
    """Where a child process is (stderr): the parent reports the last stage of one that dies."""
    print(f"stage: {name}", file=sys.stderr, flush=True)


def one_spec(spec: str, model: str, iters: int) -> dict:
    """This spec's row, in a process of its own (a capture that fails inside CUDA can leave the
    context unusable): deviation of the replays from eager steps, then the timings."""
    _, fresh = hidden_workload(model, "cuda", torch.float32)
    out: dict = {"spec": Path(spec).stem}
    timer = Timer("cuda")
    ref_params, twin_params, cap_params = fresh(), fresh(), fresh()
    ref = geomopt.GeomOptimizer(ref_params, spec)
    twin = geomopt.GeomOptimizer(twin_params, spec, capturable=True)  # the same step, eager
    cap = geomopt.GeomOptimizer(cap_params, spec, capturable=True)
    cap.step()
    for _ in range(3):
        ref.step()
        twin.step()
    torch.cuda.synchronize()
    stage("capture")
    with torch.no_grad():
        try:
            graph = captured(cap)  # 2 warm-up steps + the captured one
        except RuntimeError as exc:
            if "cannot run inside a CUDA-graph capture" not in str(exc):
                raise
            # refused before anything ran: the context works and the state is as it was
            cap.step()
            ref.step()
            torch.cuda.synchronize()
            out["refused"] = str(exc).split(", which")[0].removeprefix("geomopt: this step needs ")
            out["after_refusal"] = deviation(cap_params, ref_params)
            return out
        torch.cuda.synchronize()  # the captured step was recorded, not run: both have taken 3 steps
        stage("replay")
        for _ in range(3):
            graph.replay()
            ref.step()
            twin.step()
        torch.cuda.synchronize()
        out["deviation"] = deviation(cap_params, ref_params)
        out["vs_twin"] = deviation(cap_params, twin_params)
    stage("timing")
    muon = torch.optim.Muon([q for _, q in fresh()], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    rows = [("torch.optim.Muon", muon.step), ("eager", ref.step), ("capturable, eager", twin.step),
            ("whole step, one graph", graph.replay)]
    stage("per-bucket graphs")
    try:
        rows.insert(2, ("per-bucket graphs", geomopt.GeomOptimizer(fresh(), spec, cuda_graphs=True).step))
    except (ValueError, RuntimeError):
        pass
    for name, fn in rows:  # warm
        stage(f"warm-up: {name}")
        fn()
        torch.cuda.synchronize()
    stage("timed rounds")
    times: dict = {name: [] for name, _ in rows}
    for _ in range(iters):
        for name, fn in rows:
            times[name] += timer(fn, 0, 1)
    out["ms"] = {name: statistics.median(v) for name, v in times.items()}
    return out


def lr_check(spec: str, model: str) -> dict:
    """Largest deviation over replays whose lr was changed between them (a 0-d device tensor,
    ``fill_``ed) from eager capturable steps at the same lr values (floats)."""
    _, fresh = hidden_workload(model, "cuda", torch.float32)
    cap_params, ref_params = fresh(), fresh()
    cap = geomopt.GeomOptimizer(cap_params, spec, capturable=True)
    ref = geomopt.GeomOptimizer(ref_params, spec, capturable=True)  # eager, lr a float
    lr = torch.tensor(0.02, device=cap_params[0][1].device)
    for g in cap.param_groups:
        g["lr"] = lr
    cap.step()
    graph = captured(cap)
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):  # as the capturable one: 1 + 2 warm-up (the captured step only recorded)
            ref.step()
        for value in (0.01, 0.005, 0.03):
            lr.fill_(value)
            for g in ref.param_groups:
                g["lr"] = float(lr)
            graph.replay()
            ref.step()
            torch.cuda.synchronize()
            worst = max(worst, deviation(cap_params, ref_params))
    return {"spec": Path(spec).stem, "lr_deviation": worst}


def child(args: list, timeout: float, logs: str | None) -> dict:
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    name = Path(args[1]).stem
    if logs and run.returncode != 0:
        Path(logs).mkdir(parents=True, exist_ok=True)
        (Path(logs) / f"{name}{'-lr' if args[0] == '--one-lr' else ''}.log").write_text(run.stderr)
    if run.returncode != 0 or not run.stdout.strip():
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        stages = [line for line in lines if line.startswith("stage: ")][-1:] or ["stage: setup"]
        errors = [line for line in lines if "Error" in line.split(":")[0]][:1] or [f"exit {run.returncode}"]
        return {"spec": name, "error": f"in {stages[0][7:]}: {errors[0][:200]}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--spec", action="append", help="spec file (repeatable; default: every shipped spec)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--lr-check", action="store_true")
    p.add_argument("--timeout", type=float, default=240, help="seconds per spec (each runs in its own process)")
    p.add_argument("--logs", help="folder for the stderr of each child process that fails")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--one-lr", help=argparse.SUPPRESS)
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: a CUDA graph captures device work")
    if args.one or args.one_lr:
        print(json.dumps(one_spec(args.one, args.model, args.iters) if args.one else lr_check(args.one_lr, args.model)))
        return 0
    specs = args.spec or sorted(str(s) for s in (ROOT / "specs").glob("*.yaml"))
    common = ["--model", args.model, "--iters", str(args.iters)]
    results = [child(["--one", spec, *common], args.timeout, args.logs) for spec in specs]
    lines = [f"### Whole-step CUDA graph: {args.model} hidden matrices, {device_name('cuda')}, "
             f"torch {torch.__version__} — {datetime.date.today().isoformat()}", "",
             "ms per step, median of each row timed round-robin in the spec's own process (× that process's "
             "torch.optim.Muon).", "",
             "| spec | torch.optim.Muon | eager | per-bucket graphs | capturable, eager | whole step, one graph "
             "| graph vs eager / vs capturable eager, 3 replays |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['spec']} | – | – | – | – | failed: {r['error']} | – |")
        elif "refused" in r:
            lines.append(f"| {r['spec']} | – | – | – | – | refused before it ran: needs {r['refused']} "
                         f"(next eager step vs default: {r['after_refusal']:.1e}) | – |")
        else:
            ms = r["ms"]
            base = ms["torch.optim.Muon"]

            def cell(name, ms=ms, base=base):
                return "–" if name not in ms else f"{ms[name]:.2f} ({ms[name] / base:.3f}×)"

            lines.append(f"| {r['spec']} | {base:.2f} | {cell('eager')} | {cell('per-bucket graphs')} | "
                         f"{cell('capturable, eager')} | {cell('whole step, one graph')} | "
                         f"{r['deviation']:.1e} / {r['vs_twin']:.1e} |")
    if args.lr_check:
        r = child(["--one-lr", str(ROOT / "specs" / "muon.yaml"), "--model", args.model], args.timeout, args.logs)
        text = (f"muon.yaml, lr a 0-d device tensor changed between replays (`lr.fill_`): largest deviation from "
                f"eager capturable steps at the same lr (floats) {r['lr_deviation']:.1e}." if "lr_deviation" in r
                else f"muon.yaml, tensor lr: failed ({r['error']}).")
        lines += ["", text]
    emit("\n".join(lines), args.record, GPU)
    return 0


if __name__ == "__main__":
    sys.exit(main())
