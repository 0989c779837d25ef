"""``geomopt bench``: optimizer step time against torch.optim.Muon and fused AdamW on the same
tensors, in the same process (ratios hold across machines; absolute times drift).

The tensors are a model's hidden matrices (what Muon optimizes): the 2-D weights under
``transformer.h``. Gradients are fixed random tensors; each optimizer steps on its own copy.
"""

from __future__ import annotations

import datetime
import functools
import math
import platform
import statistics
import time

import geomopt
from geomopt.cli.status import UsageError
from geomopt.spec.shipped import shipped_folder

SPECS_DIR = shipped_folder("specs")


def hidden_matrices(model_name: str, device, dtype):
    """(name, tensor) of the model's hidden 2-D weights, allocated directly (no embeddings)."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.models import MODELS  # the models need torch: off the lint path

    with torch.device("meta"):
        model = MODELS[model_name]()
    out = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, p in model.named_parameters():
        if ".h." in name and p.ndim == 2:
            t = (torch.randn(p.shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
            out.append((name, torch.nn.Parameter(t)))
    if not out:
        raise ValueError(f"model {model_name!r} has no hidden matrices under transformer.h")
    return out


def hidden_workload(model_name: str, device, dtype):
    """(the hidden matrices, ``fresh``): ``fresh()`` gives new (name, Parameter) copies of them,
    each with the same fixed random gradient, so every optimizer compared steps on equal tensors."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    base = hidden_matrices(model_name, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-3).to(device=device, dtype=dtype) for _, p in base]

    def fresh():
        params = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in base]
        for (_, p), g in zip(params, grads):
            p.grad = g.clone()
        return params

    return base, fresh


def ns_flops(shapes, steps: int = 5) -> float:
    """FLOPs of quintic Newton–Schulz: per step, for m ≤ n, XXᵀ (2m²n), A² (2m³), (bA+cA²)X (2m²n)."""
    total = 0.0
    for shape in shapes:
        m, n = sorted(shape)
        total += steps * (4 * m * m * n + 2 * m ** 3)
    return total


class Timer:
    def __init__(self, device):
        import torch  # torch: off the lint path (a spec alone never loads it)

        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> list[float]:
        import torch  # torch: off the lint path (a spec alone never loads it)

        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return times


def bench(model_name: str, specs: list, device: str = "cpu", warmup: int = 3, iters: int = 10,
          dtype: str = "float32") -> list[dict]:
    """Rows of dict(name, ms, vs_muon, vs_adamw, tflops) for each optimizer, same tensors
    (``specs``: paths or names, or :class:`~geomopt.Spec` objects)."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    base, fresh = hidden_workload(model_name, device, getattr(torch, dtype))
    timer = Timer(device)

    candidates = [
        ("torch.optim.Muon", lambda ps: torch.optim.Muon([p for _, p in ps], lr=0.02, weight_decay=0.1,
                                                         momentum=0.95, nesterov=True)),
        ("AdamW (fused)", lambda ps: torch.optim.AdamW([p for _, p in ps], lr=1e-3, weight_decay=0.1, fused=True)),
    ]
    for spec in specs:
        loaded = spec if isinstance(spec, geomopt.Spec) else geomopt.load_spec(spec)
        candidates.append((f"geomopt {loaded.name}", functools.partial(geomopt.GeomOptimizer, spec=loaded)))
    flops = ns_flops([p.shape for _, p in base])
    opts = [(name, make(fresh())) for name, make in candidates]
    times: dict = {name: [] for name, _ in opts}
    for _ in range(warmup):
        for _, opt in opts:
            opt.step()
    # round-robin: every optimizer sees the same drift of the machine's load
    for _ in range(iters):
        for name, opt in opts:
            times[name] += timer(opt.step, 0, 1)
    rows = [dict(name=name, ms=statistics.median(times[name]), times=times[name]) for name, _ in opts]
    muon = rows[0]["ms"]
    adamw = rows[1]["ms"]
    for r in rows:
        r["vs_muon"] = r["ms"] / muon
        r["vs_adamw"] = r["ms"] / adamw
        r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12 if ("muon" in r["name"].lower()) else None
    return rows


def device_name(device: str) -> str:
    import torch  # torch: off the lint path (a spec alone never loads it)

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| optimizer | step (ms, median) | × torch Muon | × fused AdamW | NS TFLOP/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        tf = f"{r['tflops']:.2f}" if r["tflops"] is not None else "–"
        lines.append(f"| {r['name']} | {r['ms']:.2f} | {r['vs_muon']:.3f} | {r['vs_adamw']:.2f} | {tf} |")
    return "\n".join(lines)


def run(args) -> int:
    import torch  # torch: off the lint path (a spec alone never loads it)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    specs = args.spec or [str(SPECS_DIR / "muon.yaml")]
    rows = bench(args.model, specs, device=device, warmup=args.warmup, iters=args.iters)
    base = hidden_matrices(args.model, "meta", torch.float32)
    n = sum(math.prod(p.shape) for _, p in base)
    header = (f"{args.model}: {len(base)} hidden matrices, {n / 1e6:.1f}M parameters; {device_name(device)}; "
              f"torch {torch.__version__}; {datetime.date.today().isoformat()}")
    print(table(rows, header))
    return 0


def add_parser(sub) -> None:
    sp = sub.add_parser("bench", help="step time against torch.optim.Muon and fused AdamW on the same tensors")
    sp.add_argument("--model", default="gpt-bench", help="built-in model whose hidden matrices are used")
    sp.add_argument("--spec", action="append", help="spec(s) to time (default: the shipped muon); repeatable")
    sp.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    sp.add_argument("--warmup", type=int, default=3)
    sp.add_argument("--iters", type=int, default=10)
    sp.set_defaults(fn=run)
