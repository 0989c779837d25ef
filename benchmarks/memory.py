"""Optimizer-held memory: geomopt against torch's own optimizers running the same algorithm on an
HF GPT-2 (2 layers, built from a config: random init, nothing downloaded) at two widths.

    python benchmarks/memory.py [--specs muon examples/adam-all ...] [--state float32 bfloat16 int8 int8-ec] [--quick]
                                [--record NOTE]

Every shipped spec by default (specs/**/*.yaml; a spec whose algorithm no torch optimizer runs,
e.g. Lion, gets a row without the torch side). "Held" is every tensor
storage reachable from the optimizer object (its ``state``, stacked ``_buffers``, workspace,
graphs, … found by walking its attributes), each storage counted once, parameters and gradients
excluded, after 3 steps (forward, backward, step on a random token batch) so that lazily created
state exists. It is split into the state (what the algorithm keeps between steps; the ratio to
torch's is the figure to hold at 1) and geomopt's workspace (a step's scratch, shared by the
buckets, which run one after another: bounded by the largest bucket; released at the end of each
step since issue 30, so 0 between steps). The torch reference follows the geomopt plan tensor by
tensor:
adam rules → ``AdamW(fused=True)``, spectral rules with momentum → ``torch.optim.Muon`` (its
Newton–Schulz swapped for a float32 copy: bf16 is emulated on this CPU), other rules
with momentum → ``SGD(momentum=1−α)`` (heavy_ball: its own momentum, dampening and Nesterov), rules
without → ``SGD()``, each with the rule's lr, weight
decay, betas. ``--state``: geomopt's rows again with the spec's state kept in bfloat16, int8 or int8-ec
(``defaults: {state: …}``; torch's side is float32 as ever). Every (spec, width, optimizer) runs
in its own subprocess; "peak RSS Δ" is the largest rise of the process's resident set during one
``step()`` over its RSS just before (peak reset per step through /proc/self/clear_refs), over
the 3 steps, the first (state created) included: it moves by tens of MiB between runs of the same
row with the allocator's reuse of freed pages. "Step peak Δ, tally" is deterministic: one steady
step more (the state exists) under :class:`PeakTally`, the largest rise of live tensor bytes over
the step (new storages while they live, less the state it frees); "÷ float32 state's" divides it
by the same spec's float32 row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted(str(p.relative_to(ROOT / "specs"))[:-len(".yaml")] for p in (ROOT / "specs").rglob("*.yaml"))
WIDTHS = [(384, 8192), (768, 50257)]  # (n_embd, vocab)
QUICK_WIDTHS = [(64, 512)]
MiB = 2 ** 20


# ---------------------------------------------------------------------------------- the worker

def held_storages(root, exclude: set[int]) -> dict[int, tuple[int, str]]:
    """data_ptr → (bytes, label) of every tensor storage reachable from ``root`` (dicts, lists,
    tuples, sets, ``functools.partial`` and the ``__dict__`` of non-torch objects, recursively),
    each storage once, the ``exclude`` pointers left out. The label is the first path it was
    reached by, shortened to what names it (``state.exp_avg``, ``_buffers.u``)."""
    import functools

    import torch

    seen, out = set(), {}

    def label(path: tuple) -> str:
        head = path[0]
        if head == "state":  # state[param][key]
            return f"state.{path[2]}" if len(path) > 2 else "state"
        if head == "engine" and len(path) > 1:  # the step's owner (geomopt.optim.engine.engine)
            path = path[1:]
            head = path[0]
        if head == "rt" and len(path) > 1:  # the step's runtime (geomopt.optim.engine.runtime)
            path = path[1:]
            head = path[0]
        if head == "workspace":  # workspace._buffers[(slot, device, dtype)]
            return f"workspace.{path[2][0]}" if len(path) > 2 and isinstance(path[2], tuple) else "workspace"
        if head == "stacked" and len(path) > 2 and isinstance(path[2], tuple):  # stacked.buffers[(ids…, key)]
            tags = [t for t in path[2] if isinstance(t, str)]
            return "_buffers." + "/".join(tags) if tags else "_buffers"
        return ".".join(str(p) for p in path if isinstance(p, str))

    def visit(obj, path):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad is not None:
                visit(obj.grad, path + ("grad",))
            s = obj.untyped_storage()
            ptr = s.data_ptr()
            if ptr and ptr not in exclude and ptr not in out:
                out[ptr] = (s.nbytes(), label(path))
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(k, path + ("<key>",))
                visit(v, path + (k if isinstance(k, (str, tuple)) else "<p>",))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                visit(v, path)
        elif isinstance(obj, functools.partial):
            visit(obj.args, path)
            visit(obj.keywords, path)
        elif isinstance(obj, torch.nn.Module):
            return  # a model is parameters and buffers of its own, not the optimizer's
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k, v in vars(obj).items():
                visit(v, path + (k,))

    visit(root, ())
    return out


class PeakTally:
    """The rise of live tensor bytes over a piece of code, at its peak: a ``TorchDispatchMode`` sees
    every aten op's outputs; a storage that is none of the op's inputs' (not an in-place, ``out=`` or
    view op's) is new, counted from that op until it is freed (a finalizer on its storage), and a
    storage of ``held`` (tensors alive at the start: the optimizer's state) that is freed on the way
    (a state replaced by a new one) is subtracted from then on. Deterministic, unlike the resident
    set, which moves with the allocator's reuse of freed pages; blind to what a kernel allocates
    and frees inside itself, and to memory that is not a tensor's.

        with PeakTally(held=state_tensors) as tally:
            opt.step()
        tally.peak  # bytes: the largest rise, after any op
    """

    def __init__(self, held=()):
        self.live = self.peak = 0
        self.held = list(held)
        self._mode = None

    def __enter__(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tally = self
        tracked: dict = {}

        def freed(ptr: int, nbytes: int) -> None:
            tracked.pop(ptr, None)
            seen.discard(ptr)  # its address may be a new storage's now
            tally.live -= nbytes

        seen: set = set()
        for t in self.held:
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                weakref.finalize(s, freed, s.data_ptr(), s.nbytes())
        self.held = []  # no reference of the tally's keeps them alive

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type != "meta"}
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    s = t.untyped_storage()
                    ptr, nbytes = s.data_ptr(), s.nbytes()
                    if not nbytes or ptr in inputs or ptr in tracked or ptr in seen:
                        continue
                    tracked[ptr] = nbytes
                    tally.live += nbytes
                    weakref.finalize(s, freed, ptr, nbytes)
                tally.peak = max(tally.peak, tally.live)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def state_tensors(opt) -> list:
    """The tensors of an optimizer's ``state`` (torch's per-parameter dicts)."""
    import torch

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's quintic Newton–Schulz, in float32 (torch's runs in bfloat16, which this
    CPU only emulates, ~100× slower); the held state is the same either way."""
    import torch

    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def torch_reference(model, plan):
    """torch optimizers running each tensor's algorithm of ``plan``, one group per rule."""
    import torch

    params = dict(model.named_parameters())
    rules: dict[str, list] = {}
    for pp in plan:
        rules.setdefault(pp.rule, []).append(pp)
    adam, muon, sgd = [], [], []
    for name, pps in rules.items():
        pp = pps[0]
        geometry, direction = pp.geometry, pp.direction
        group = {"params": [params[q.name] for q in pps], "lr": pp.lr, "weight_decay": pp.weight_decay}
        # one momentum buffer: polyak's EMA, or heavy_ball's (torch.optim.SGD's own momentum)
        if direction["kind"] not in ("polyak", "heavy_ball", "none"):
            raise SystemExit(f"rule {name}: no torch reference for direction {direction['kind']}")
        momentum = 1 - direction["alpha"] if direction["kind"] == "polyak" else direction.get("momentum", 0.0)
        if geometry["kind"] == "adam":
            if direction["kind"] != "none":
                raise SystemExit(f"rule {name}: adam with a direction has no torch reference")
            adam.append(group | {"betas": tuple(geometry.get("betas", (0.9, 0.999)))})
        elif geometry["kind"] == "spectral" and momentum:
            muon.append(group | {"momentum": momentum, "nesterov": direction.get("nesterov", False)})
        else:
            sgd.append(group | {"momentum": momentum, "nesterov": bool(momentum and direction.get("nesterov")),
                                "dampening": direction.get("dampening", 0.0)})
    opts = []
    if muon:
        import torch.optim._muon

        torch.optim._muon._zeropower_via_newtonschulz = newton_schulz_float32
        opts.append(torch.optim.Muon(muon, adjust_lr_fn="original"))
    if adam:
        opts.append(torch.optim.AdamW(adam, fused=True))
    if sgd:
        opts.append(torch.optim.SGD(sgd))
    return opts


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(job: dict) -> dict:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    import geomopt

    torch.manual_seed(0)
    width, vocab, seq, batch = job["width"], job["vocab"], job["seq"], job["batch"]
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
                                     n_positions=seq)
    model = transformers.GPT2LMHeadModel(config).float()
    spec = str(ROOT / "specs" / f"{job['spec']}.yaml")
    if job.get("state", "float32") != "float32":  # the shipped spec with its state in another precision
        spec = {"geomopt": 1, "name": f"{job['spec']}-{job['state']}", "extends": spec,
                "defaults": {"state": job["state"]}}
    geo = geomopt.GeomOptimizer(model, spec)
    named = dict(model.named_parameters())
    buckets: dict[str, int] = {}
    for pp in geo.plan:
        t = named[pp.name]
        buckets[pp.bucket] = buckets.get(pp.bucket, 0) + t.numel() * t.element_size()
    if job["side"] == "geomopt":
        opts = [geo]
    else:
        try:
            opts = torch_reference(model, geo.plan)
        except SystemExit as err:  # no torch optimizer runs this algorithm: the row says so
            return {"no_reference": str(err)}
    del geo
    params = list({id(p): p for p in model.parameters()}.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    deltas, exact = [], True
    for _ in range(job["steps"]):
        model(tokens, labels=tokens).loss.backward()
        exact = peak_reset() and exact
        before = rss_now() if exact else peak_rss()
        for opt in opts:
            opt.step()
        deltas.append(peak_rss() - before)
        for opt in opts:
            opt.zero_grad()
    # one step more under the dispatch tally (steady state: the state exists): its peak of live bytes
    model(tokens, labels=tokens).loss.backward()
    with PeakTally(held=[t for opt in opts for t in state_tensors(opt)]) as tally:
        for opt in opts:
            opt.step()
    exclude = {p.untyped_storage().data_ptr() for p in params}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    held = held_storages(opts, exclude)
    by_label: dict[str, int] = {}
    for nbytes, name in held.values():
        by_label[name] = by_label.get(name, 0) + nbytes
    workspace = sum(b for b, name in held.values() if name.startswith("workspace"))
    return {"held": sum(b for b, _ in held.values()), "workspace": workspace, "largest_bucket": max(buckets.values()),
            "param_bytes": param_bytes, "rss_delta": max(deltas), "tally_peak": tally.peak,
            "rss_exact": exact, "by_label": by_label,
            "optimizers": [type(o).__name__ + ("(fused)" if o.defaults.get("fused") else "") for o in opts]}


# ------------------------------------------------------------------------------------- the table

def run_job(job: dict) -> dict:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                          text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEMORY ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {job} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("MEMORY "):])


def _over(peak: int, base) -> str:
    """``peak`` ÷ the float32 state's ``base`` ("—" without a float32 row; the MiB over a base under 1 KiB)."""
    if base is None:
        return "—"
    if base < 2 ** 10:  # a step that allocates nothing but scalars (torch's fused AdamW over float32 state)
        return f"+{(peak - base) / MiB:.2f} MiB"
    return f"{peak / base:.3f}"


def breakdown(by_label: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MiB:.2f}" for k, v in sorted(by_label.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", nargs="+", default=SPECS, help="shipped spec names (specs/NAME.yaml)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes (width 64, vocab 512) for a smoke test")
    p.add_argument("--record", metavar="NOTE", help="record the tables in benchmarks/RESULTS.md with this note")
    p.add_argument("--jobs", type=int, default=2, help="subprocesses at a time (each measures only itself)")
    p.add_argument("--widths", type=int, nargs="+", help="model widths (384, 768; default both)")
    p.add_argument("--state", nargs="+", default=["float32"], choices=["float32", "bfloat16", "int8", "int8-ec"],
                   help="geomopt's state precision(s), a row each (default float32)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("MEMORY " + json.dumps(worker(json.loads(args.worker))))
        return 0
    widths = QUICK_WIDTHS if args.quick else [w for w in WIDTHS if not args.widths or w[0] in args.widths]
    seq, batch = (16, 2) if args.quick else (128, 4)
    import torch

    from geomopt.cli.bench import device_name

    for width, vocab in widths:
        lines = [f"### Optimizer-held memory: HF GPT-2 (2 layers, width {width}, vocab {vocab}, "
                 f"batch {batch}×{seq}), {args.steps} steps, {device_name('cpu')}, float32, torch "
                 f"{torch.__version__} — {datetime.date.today().isoformat()}", "",
                 "| spec | state | geomopt state (MiB) | torch state (MiB) | state ratio | geomopt workspace (MiB) "
                 "| largest bucket (MiB) | held / param bytes (geomopt) | held / param bytes (torch) "
                 "| peak RSS Δ in step (geomopt, MiB) | peak RSS Δ in step (torch, MiB) "
                 "| step peak Δ, tally (geomopt, MiB) | ÷ float32 state's | step peak Δ, tally (torch, MiB) |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        notes = []
        base = {"width": width, "vocab": vocab, "seq": seq, "batch": batch, "steps": args.steps}
        jobs = [dict(base, spec=spec, side=side, state=state) for spec in args.specs
                for side, state in [("torch", "float32"), *(("geomopt", s) for s in args.state)]]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(run_job, jobs))
        per = 1 + len(args.state)
        rows = [(job["spec"], job["state"], g, results[i - i % per]) for i, (job, g) in enumerate(zip(jobs, results))
                if job["side"] == "geomopt"]
        base = {spec: g["tally_peak"] for spec, precision, g, _ in rows if precision == "float32"}
        for spec, precision, g, t in rows:
            pb = g["param_bytes"]
            tally = f"{g['tally_peak'] / MiB:.2f} | {_over(g['tally_peak'], base.get(spec))}"
            state = g["held"] - g["workspace"]
            if "no_reference" in t:
                lines.append(f"| {spec}.yaml | {precision} | {state / MiB:.2f} | — | — | {g['workspace'] / MiB:.2f} | "
                             f"{g['largest_bucket'] / MiB:.2f} | {g['held'] / pb:.3f} | — | "
                             f"{g['rss_delta'] / MiB:.1f} | — | {tally} | — |")
                notes.append(f"- {spec}.yaml ({precision}) — geomopt: {breakdown(g['by_label'])}; torch: "
                             f"{t['no_reference']}")
                continue
            # torch holding nothing (SGD without momentum): what geomopt holds, in bytes
            ratio = f"{state / t['held']:.3f}" if t["held"] else ("1.000" if not state else f"+{state} B")
            lines.append(f"| {spec}.yaml | {precision} | {state / MiB:.2f} | {t['held'] / MiB:.2f} | {ratio} | "
                         f"{g['workspace'] / MiB:.2f} | {g['largest_bucket'] / MiB:.2f} | {g['held'] / pb:.3f} | "
                         f"{t['held'] / pb:.3f} | {g['rss_delta'] / MiB:.1f} | {t['rss_delta'] / MiB:.1f} | "
                         f"{tally} | {t['tally_peak'] / MiB:.2f} |")
            notes.append(f"- {spec}.yaml ({precision}) — geomopt: {breakdown(g['by_label'])}; torch "
                         f"({' + '.join(t['optimizers'])}): {breakdown(t['by_label'])}")
        exact = ("" if all(r.get("rss_exact", True) for r in results)
                 else " (peak RSS: ru_maxrss, no per-step reset here)")
        lines += ["", f"Parameter bytes: {pb / MiB:.2f} MiB. Held MiB by holder{exact}:", *notes]
        emit("\n".join(lines), args.record, "Memory")  # each width as soon as it is measured
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    if "--worker" not in sys.argv:
        print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(code)
