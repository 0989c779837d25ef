"""What QK-clip costs: the attention monitor's overhead on a training forward + backward, and the
clip after the step.

The monitor (geomopt/monitor.py) computes each SDPA call's scores once more (q·kᵀ, one extra
matmul of the scores' size, chunked) and takes an ``amax`` of the scores an eager softmax already
has. Workloads (random init, no download):

* ``gpt``: geomopt's GPT (SDPA, fused c_attn), 4 layers, width 256, 8 heads, 256 tokens × batch 8;
* ``llama-sdpa`` / ``llama-eager``: Hugging Face Llama from a config, 4 layers, width 256, 8 heads
  (4 key/value heads), 256 tokens × batch 4, ``attn_implementation`` sdpa / eager.

Per workload: the median (of the process's CPU time on a CPU, robust to other load on a shared
machine; of wall time on CUDA) over ``--iters`` rounds (round robin, after warm-up) of forward +
backward without and with the monitor, of ``GeomOptimizer.step()`` (Muon-like spectral rule on
q/k, Adam elsewhere) without and with ``qk_clip`` (τ below the logits, so every head is clipped),
and of the clip alone (:func:`geomopt.optim.engine.qkclip.clip_site` on every site).
Writes benchmarks/results/qk_monitor.json (or ``--out``); ``--record`` puts each row in place
of the same workload's under "## QK-clip" in benchmarks/RESULTS.md.

    python benchmarks/qk_monitor.py [--iters 20] [--device cpu|cuda] [--record] [--note TEXT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import geomopt  # noqa: E402
from geomopt.models import GPT, GPTConfig  # noqa: E402
from geomopt.optim.engine.qkclip import clip_site  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import record_row, workload_key  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "qk_monitor.json"
SPEC = """geomopt 1
name "bench-qk"
rule qk match "re:.*(q_proj|k_proj|c_attn)\\\\.weight":
    geometry spectral(indicator, approx=newton_schulz(), view=auto)
    {clip}
rule rest match "**":
    geometry adam
"""


def build(workload: str, small: bool, device: str):
    torch.manual_seed(0)
    width, layers, heads, seq, batch = (32, 2, 4, 16, 2) if small else (256, 4, 8, 256, 8)
    if workload == "gpt":
        model = GPT(GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=heads, n_embd=width))
        ids = torch.randint(0, 512, (batch, seq))

        def loss(m):
            return m(ids.to(device), ids.to(device))[1]
    else:
        import transformers

        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=width, intermediate_size=2 * width,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=heads // 2, max_position_embeddings=seq,
                                       attn_implementation=workload.split("-")[1])
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 512, (max(1, batch // 2), seq))

        def loss(m):
            return m(input_ids=ids.to(device), labels=ids.to(device)).loss
    return model.to(device).train(), loss


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(workload: str, iters: int, small: bool, device: str) -> dict:
    model, loss = build(workload, small, device)
    watched, _ = build(workload, small, device)
    handle = geomopt.monitor_attention(watched)

    def fwd_bwd(m):
        def run():
            m.zero_grad(set_to_none=True)
            loss(m).backward()
            _sync(device)
        return run

    rows = {"forward+backward": fwd_bwd(model), "forward+backward, monitored": fwd_bwd(watched)}
    times = _round_robin(rows, iters)
    fwd_bwd(watched)()
    tau = 0.5 * float(min(s.maxima.min() for s in handle.sites))  # every head clipped
    opts = {}
    for name, m, clip in (("step", model, ""), ("step + qk_clip", watched, f"qk_clip=max_logit(tau={tau:.6g})")):
        opt = geomopt.GeomOptimizer(m, SPEC.format(clip=clip))

        def step(opt=opt, m=m):
            for s in handle.sites:  # keep the logits the clip reads (a step consumes them)
                s.maxima = s.maxima if s.maxima is not None else torch.full((s.heads,), 4 * tau, device=device)
            opt.step()
            _sync(device)
        opts[name] = step
    times.update(_round_robin(opts, iters))

    def clip_alone():
        for s in handle.sites:
            clip_site(s, torch.full((s.heads,), 4 * tau, device=device), tau, 0.5)
        _sync(device)
    times.update(_round_robin({"clip alone": clip_alone}, iters))
    handle.remove()
    fb, fbm = times["forward+backward"], times["forward+backward, monitored"]
    st, stc = times["step"], times["step + qk_clip"]
    return dict(workload=workload, device=device, ms=times, monitor_overhead=fbm / fb - 1,
                clip_overhead_ms=stc - st, sites=len(handle.sites))


def _clock() -> float:
    """CPU: the process's CPU time (all threads; robust to other load on a shared machine); CUDA:
    wall time (each row synchronizes)."""
    return time.perf_counter() if torch.cuda.is_available() and _DEVICE[0].startswith("cuda") else time.process_time()


_DEVICE = ["cpu"]


def _round_robin(rows: dict, iters: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        for fn in rows.values():
            fn()
    times: dict = {k: [] for k in rows}
    for _ in range(iters):
        for k, fn in rows.items():
            t0 = _clock()
            fn()
            times[k].append((_clock() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


def row(r: dict, note: str) -> str:
    ms = r["ms"]
    return (f"| {datetime.date.today().isoformat()} | {machine(r['device'])} | torch {torch.__version__} "
            f"| {r['workload']} | {ms['forward+backward']:.1f} | {ms['forward+backward, monitored']:.1f} "
            f"| {100 * r['monitor_overhead']:+.1f}% | {ms['step']:.2f} | {ms['step + qk_clip']:.2f} "
            f"| {ms['clip alone']:.3f} | {note} |")


SECTION = "QK-clip (`benchmarks/qk_monitor.py`)"
INTRO = ["The attention monitor's cost on a training forward + backward (median ms: the process's CPU time "
         "on a CPU, wall time on CUDA; the monitor recomputes "
         "each SDPA call's scores once, or takes an amax of an eager softmax's input) and the optimizer step "
         "without / with `qk_clip` (every head clipped), and the clip alone (every site's q/k rows rescaled).", "",
         "| date | machine | torch | workload | fwd+bwd | fwd+bwd monitored | overhead | step | step + qk_clip "
         "| clip alone | note |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]


def record(rows: list[str]) -> None:
    """Each row in place of the same workload's on the same machine, under the QK-clip section."""
    for r in rows:
        record_row(SECTION, INTRO, r, workload_key)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", nargs="+", default=["gpt", "llama-sdpa", "llama-eager"],
                    choices=["gpt", "llama-sdpa", "llama-eager"])
    ap.add_argument("--small", action="store_true", help="tiny models (the test's smoke run)")
    ap.add_argument("--out", type=Path, default=OUT, help="the results JSON")
    ap.add_argument("--record", action="store_true", help="record the rows in benchmarks/RESULTS.md")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    _DEVICE[0] = args.device
    results = [bench(w, args.iters, args.small, args.device) for w in args.workloads]
    load = f"load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") and args.device == "cpu" else ""
    note = "; ".join(x for x in (args.note, load) if x)
    rows = [row(r, note) for r in results]
    print("\n".join(INTRO[2:]))
    print("\n".join(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                                        machine=machine(args.device), iters=args.iters, small=args.small,
                                        results=results), indent=1) + "\n", encoding="utf-8")
    if args.record:
        record(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
