"""Memory traffic of one optimizer step against its physical floor, counted at the dispatcher.

    python benchmarks/traffic.py [--small] [--specs muon adamw …] [--no-torch] [--capturable] [--fuse] [--record]

A ``TorchDispatchMode`` sees every aten op that one ``opt.step()`` runs (after ``--warmup``
steps, so the state exists) and counts the bytes it reads and writes: a tensor argument is
``numel × itemsize`` of what the op touches (a view: its own numel), a foreach op sums over its
lists, an argument the op's schema marks as written (``Tensor(a!)``) is written (and read, unless
the op only overwrites it: ``copy_``, ``fill_``, ``zero_``, an ``out=``), every new output is
written; views, ``empty`` and metadata ops touch nothing.

A compiled region (``GeomOptimizer(fuse=True)``: :mod:`geomopt.optim.engine.fused`) runs
inductor's kernels, which the dispatcher never sees, and ``torch.compile`` refuses to trace under a
dispatch mode; so the counter replaces ``fused.run``, the one place such a region is called, and
counts it as one op (``compiled:<function>``) the way a fused kernel moves memory at best, from
what the call declares (``run(fn, out, written, read, …)``): every tensor it reads (``written``,
``read``, its 0-d coefficients) read once, every tensor it writes (``out``, ``written``) written
once, whatever inductor keeps in registers in between. That is a lower bound for the region (a
generated kernel that re-read an input would not be seen); the region runs with the counting mode
set aside. ``--capturable`` with ``--fuse`` adds each spec with both (``capturable, fused``).

The floor is what any implementation must move: each gradient read once, each state tensor read
and written once, each parameter read and written once (the *elementwise floor*), plus the bytes
of the matrix products (``mm``, ``bmm``, ``addmm``, ``baddbmm``, …: their operands and results,
counted as measured, as the floor of the spectral part). Per spec: total bytes, floor bytes and
their ratio, the elementwise part apart (the bytes of every op that is not a matrix product
against the elementwise floor), and the ops that move the most bytes.

The model has GPT-2-small's parameters (Hugging Face's ``GPT2LMHeadModel`` built from a config
where transformers is installed, else :class:`geomopt.models.GPT` with GPT-2's names, shapes
transposed): wte 50257×768, wpe 1024×768, 12 layers of c_attn 768×2304, c_proj 768×768, c_fc
768×3072, mlp c_proj 3072×768, layer norms and biases; random init, random gradients.
``--small``: width 64, 2 layers, vocab 512 (seconds). geomopt's specs step on the CPU; torch's
own optimizers as references (``torch.optim.Muon`` on the hidden matrices with fused
``AdamW`` on the rest, beside ``muon``; fused ``AdamW`` on everything, beside ``adamw``) step on
the CPU too, but for torch's Muon, which steps meta copies of its tensors, where only shapes
exist (the counts read shapes alone, and torch's Muon iterates in bfloat16, which this CPU
emulates at about 1/100 of float32's speed).

``--record`` writes benchmarks/results/traffic.json and appends the table to
benchmarks/RESULTS.md; otherwise the record goes to ``--out``/traffic.json (default runs/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit  # noqa: E402

import geomopt  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "traffic.json"
#: geomopt's shipped or catalogue specs measured by default (``adamw``: Adam(W) on every tensor)
SPECS = ["muon", "adamw-hybrid", "adamw", "sign-descent", "normuon"]
#: the matrix products, whose operands and results are the floor of a spectral step
MATMUL_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation"})
#: in-place matrix products X ← β·X + α·A·B, by the product they run: the written addend X's read and
#: write are the elementwise part (a write-back's pass over X, done inside the product), the operands
#: A and B the matmul part
EPILOGUE_OPS = {"addmm_": "addmm", "baddbmm_": "baddbmm"}
#: ops whose written arguments they only overwrite (nothing of them is read)
OVERWRITE_OPS = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_",
                           "random_", "_foreach_fill_"})
#: ops that allocate without touching memory
ALLOC_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                       "empty_permuted", "resize_"})
#: views whose schema does not say so (a reshape's result reusing its input's storage)
VIEW_OPS = frozenset({"_unsafe_view"})
#: torch's fused Adam kernels mark their gradients written: they are only when a grad scale is given
SCALED_GRADS = {"_fused_adamw_": "grad_scale", "_fused_adam_": "grad_scale"}


def tensor_bytes(value) -> int:
    """numel × itemsize of a tensor, or summed over a list of them; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def op_traffic(func, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(bytes read, bytes written) by one aten op call, from its schema: arguments marked as
    written are written (and read unless the op overwrites them); new outputs are written;
    outputs that alias an argument (views, in-place results) add nothing."""
    name = func.overloadpacket.__name__
    schema = func._schema
    reads = writes = 0
    written_any = False
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        n = tensor_bytes(value)
        if not n:
            continue
        written = arg.alias_info is not None and arg.alias_info.is_write
        if written and name in SCALED_GRADS and arg.name == "grads" and kwargs.get(SCALED_GRADS[name]) is None:
            written = False
        if written:
            written_any = True
            writes += n
            if not (arg.kwarg_only or name in OVERWRITE_OPS or name == "resize_"):
                reads += n
        else:
            reads += n
    if name in ALLOC_OPS or name in VIEW_OPS:
        return 0, 0
    aliased = [r.alias_info is not None for r in schema.returns]
    if schema.returns and all(aliased) and not written_any:
        return 0, 0  # a view: nothing is touched
    outs = out if isinstance(out, (list, tuple)) else (out,)
    for r, value in zip(schema.returns, outs if len(schema.returns) > 1 else (out,)):
        if r.alias_info is None:
            writes += tensor_bytes(value)
    return reads, writes


class Traffic(TorchDispatchMode):
    """Bytes read and written by the aten ops run under it, per op name (``ops[name] = [calls,
    read, written]``); ``matmul`` sums the matrix products' part."""

    def __init__(self):
        super().__init__()
        self.ops: dict = defaultdict(lambda: [0, 0, 0])
        self._run = None

    def __enter__(self):
        from geomopt.optim.engine import fused
        self._run = fused.run

        def counted(fn, out: list, written: list, read: list, *args):
            """A compiled region: what it reads, read once; what it writes, written once."""
            row = self.ops[f"compiled:{getattr(fn, '__name__', 'region')}"]
            row[0] += 1
            row[1] += tensor_bytes(list(written) + list(read) + [a for a in args if torch.is_tensor(a)])
            row[2] += tensor_bytes(list(out) + list(written))
            with _disable_current_modes():
                return self._run(fn, out, written, read, *args)

        fused.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from geomopt.optim.engine import fused
        fused.run = self._run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        r, w = op_traffic(func, args, kwargs, out)
        name = func.overloadpacket.__name__
        if name in EPILOGUE_OPS:  # the operands' reads to the product, the addend's read and write here
            addend = tensor_bytes(args[0])
            self._add(EPILOGUE_OPS[name], r - addend, 0)
            r = addend
        self._add(name, r, w)
        return out

    def _add(self, name: str, read: int, written: int) -> None:
        row = self.ops[name]
        row[0] += 1
        row[1] += read
        row[2] += written

    @property
    def total(self) -> int:
        return sum(r + w for _, r, w in self.ops.values())

    @property
    def matmul(self) -> int:
        return sum(r + w for name, (_, r, w) in self.ops.items() if name in MATMUL_OPS)


def elementwise_floor(params: list, state: dict) -> dict:
    """Each gradient read once, each state tensor and each parameter read and written once."""
    grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    weights = sum(tensor_bytes(p) for p in params if p.grad is not None)
    seen: set = set()
    held = 0
    for st in state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:  # a count a bucket shares: once
                seen.add(id(v))
                held += tensor_bytes(v)
    return dict(grads=grads, params=2 * weights, state=2 * held, total=grads + 2 * weights + 2 * held)


# ---------------------------------------------------------------- the model


def gpt2(small: bool, device="cpu") -> torch.nn.Module:
    """GPT-2-small's parameters (``small``: width 64, 2 layers, vocab 512), random init."""
    size = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=512, n_positions=64) if small else \
        dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    try:
        import transformers
    except ImportError:
        from geomopt.models import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=size["vocab_size"], block_size=size["n_positions"], n_layer=size["n_layer"],
                             n_head=size["n_head"], n_embd=size["n_embd"], tie_weights=True)).to(device)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**size))


def random_grads(params: list, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) if p.device.type != "meta" else torch.empty_like(p)
        p.grad = g.to(p.device)


def measure(model: torch.nn.Module, make_opt: Callable, warmup: int) -> dict:
    """One step's traffic (after ``warmup`` steps) against its floor."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(model)
    for k in range(warmup):
        random_grads(params, k)
        opt.step()
    random_grads(params, warmup)
    with Traffic() as t:
        opt.step()
    floor = elementwise_floor(params, opt.state)
    total, matmul = t.total, t.matmul
    top = sorted(t.ops.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:8]
    return dict(
        total_bytes=total, floor_bytes=floor["total"] + matmul, ratio=total / (floor["total"] + matmul),
        matmul_bytes=matmul, elementwise_bytes=total - matmul, elementwise_floor_bytes=floor["total"],
        elementwise_ratio=(total - matmul) / floor["total"], floor_parts=floor,
        parameters=sum(p.numel() for p in params),
        top_ops=[dict(op=name, calls=c, read_bytes=r, written_bytes=w) for name, (c, r, w) in top],
    )


def geomopt_optimizer(spec: str, capturable: bool = False, fuse: bool = False) -> Callable:
    def make(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return geomopt.GeomOptimizer(model, spec, capturable=capturable, fuse=fuse)
    return make


def hidden_names(model: torch.nn.Module) -> set:
    """The tensors the ``muon`` spec steps spectrally (its ``hidden`` rule)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = geomopt.GeomOptimizer(model, "muon")
    return {n for g in opt.param_groups if g["rule"] == "hidden" for n in g["param_names"]}


def torch_muon(hidden: set) -> Callable:
    """torch.optim.Muon on ``hidden`` (by name), fused AdamW on the rest (muon.yaml's rates).
    Muon steps meta copies of its tensors (shapes only: its bfloat16 iteration is emulated on this
    CPU), fused AdamW the tensors themselves (torch has no fused kernel for meta tensors)."""
    class Pair:
        def __init__(self, model):
            named = list(model.named_parameters())
            self.pairs = [(p, torch.empty_like(p, device="meta")) for n, p in named if n in hidden]
            self.opts = [torch.optim.Muon([m for _, m in self.pairs], lr=0.02, weight_decay=0.1),
                         torch.optim.AdamW([p for n, p in named if n not in hidden], lr=1e-3, weight_decay=0.1,
                                           fused=True)]
            self.state: dict = {}

        def step(self):
            for p, m in self.pairs:
                m.grad = None if p.grad is None else torch.empty_like(p.grad, device="meta")
            for o in self.opts:
                o.step()
            self.state = {p: s for o in self.opts for p, s in o.state.items()}
    return Pair


def torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)


def rows(specs: list, small: bool, warmup: int, with_torch: bool, log=print, capturable: bool = False,
         fuse: bool = False) -> list:
    out = []
    for spec in specs:
        log(f"{spec} …")
        out.append(dict(name=spec, kind="geomopt", device="cpu", **measure(gpt2(small), geomopt_optimizer(spec),
                                                                           warmup)))
        if capturable:  # the same spec with capturable=True: its passes against the eager step's
            log(f"{spec} (capturable) …")
            out.append(dict(name=f"{spec} (capturable)", kind="geomopt", beside=spec, device="cpu",
                            **measure(gpt2(small), geomopt_optimizer(spec, capturable=True), warmup)))
        if fuse:  # the same spec with fuse=True: compiled regions counted as fused kernels (see the module)
            log(f"{spec} (fused) …")
            out.append(dict(name=f"{spec} (fused)", kind="geomopt", beside=spec, device="cpu",
                            **measure(gpt2(small), geomopt_optimizer(spec, fuse=True), warmup)))
        if capturable and fuse:  # both: the compiled loops select the gradients by the device's flag themselves
            log(f"{spec} (capturable, fused) …")
            out.append(dict(name=f"{spec} (capturable, fused)", kind="geomopt", beside=spec, device="cpu",
                            **measure(gpt2(small), geomopt_optimizer(spec, capturable=True, fuse=True), warmup)))
        if with_torch and spec == "muon":
            model = gpt2(small)
            log("torch.optim.Muon + AdamW(fused) …")
            out.append(dict(name="torch Muon + AdamW (fused)", kind="torch", beside=spec, device="meta + cpu",
                            **measure(model, torch_muon(hidden_names(model)), warmup)))
        if with_torch and spec == "adamw":
            log("torch.optim.AdamW(fused) …")
            out.append(dict(name="torch AdamW (fused)", kind="torch", beside=spec, device="cpu",
                            **measure(gpt2(small), torch_adamw, warmup)))
    return out


def table(record: dict) -> str:
    mb = 1 / 2**20
    kind = "GPT-2-small's" if not record["small"] else "a small GPT's (--small)"
    lines = [f"### Step traffic against the floor, {kind} {record['parameters'] / 1e6:.1f}M parameters "
             f"(dispatch-level count) — {record['date'][:10]}, torch {record['torch']}",
             "", "| optimizer | total (MiB) | floor (MiB) | × floor | elementwise (MiB) | elementwise floor (MiB) "
             "| × elementwise floor | matmul (MiB) | top ops by bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        moved = [o for o in r["top_ops"] if (o["read_bytes"] + o["written_bytes"]) * mb >= 0.5][:4]  # shown: MiB
        top = ", ".join(f"{o['op']} {(o['read_bytes'] + o['written_bytes']) * mb:.0f}" for o in moved)
        lines.append(f"| {r['name']} | {r['total_bytes'] * mb:.0f} | {r['floor_bytes'] * mb:.0f} | {r['ratio']:.2f} "
                     f"| {r['elementwise_bytes'] * mb:.0f} | {r['elementwise_floor_bytes'] * mb:.0f} "
                     f"| {r['elementwise_ratio']:.2f} | {r['matmul_bytes'] * mb:.0f} | {top} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", nargs="+", default=SPECS, help="spec names (geomopt.shipped_specs()) or paths")
    ap.add_argument("--small", action="store_true", help="width 64, 2 layers, vocab 512: seconds")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the counted one (the state exists)")
    ap.add_argument("--no-torch", action="store_true", help="leave out torch's optimizers")
    ap.add_argument("--capturable", action="store_true", help="each spec also with capturable=True")
    ap.add_argument("--fuse", action="store_true", help="each spec also with fuse=True (compiled elementwise steps)")
    ap.add_argument("--record", action="store_true",
                    help="write benchmarks/results/traffic.json and append the table to benchmarks/RESULTS.md")
    ap.add_argument("--out", metavar="DIR", default="runs", help="folder for traffic.json without --record")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    measured = rows(args.specs, args.small, args.warmup, not args.no_torch, log=lambda s: print(s, file=sys.stderr),
                    capturable=args.capturable, fuse=args.fuse)
    record = dict(command="python benchmarks/traffic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, small=args.small, warmup=args.warmup,
                  parameters=measured[0]["parameters"], rows=measured)
    path = RECORD if args.record else Path(args.out) / "traffic.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    steps = f"{args.warmup} warm-up step{'s' if args.warmup != 1 else ''}"
    note = (f"`{record['command']}`: one step after {steps}, random gradients; "
            "bytes counted per aten op (reads + writes; "
            "views free). Floor: each gradient read, each state tensor and parameter read and written once, "
            "plus the matrix products' operands and results; elementwise: every op but the matrix products "
            "against the first part. torch's Muon stepped on the meta device (shapes only), the rest on the CPU.")
    emit(table(record), note if args.record else None, "Memory traffic")
    return 0


if __name__ == "__main__":
    sys.exit(main())
