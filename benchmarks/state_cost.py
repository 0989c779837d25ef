"""What each state precision costs per step and holds per parameter, in one process: a spec's
optimizer with its state in float32, bfloat16, int8 and int8-ec stepping copies of the same
tensors (the hidden matrices of ``--model``, each with the same fixed gradient), round-robin with
the order reversed every round (benchmarks/ab.py's method: the machine's drift hits every row
alike).

    python benchmarks/state_cost.py [--model gpt-bench] [--specs muon examples/adam-all] [--iters 20]
                                    [--device cpu] [--fuse] [--record NOTE]
    python benchmarks/state_cost.py --parts [--iters 20]

Reported per (spec, precision): the median step, its ratio to float32 state's, the codec alone
(every encoded moment of the state decoded and encoded once, in the chunks a flat step takes,
through the workspace: what a step with that state spends besides its arithmetic, a lower bound
on its cost) over float32 state's step, and the bytes the state holds per parameter (every tensor
of ``opt.state``: codes, scales, corrections, moments, counts) and over float32's. A second float32
optimizer is timed as its own row (A/A: the spread the method leaves between equal steps).
``--fuse``: every precision again under ``GeomOptimizer(fuse=True)`` (an encoded flat rule's codec
compiled, an Adam rule's each piece whole in one call: ``geomopt.optim.engine.fused``), in the same
round robin, each also over the fuse=True float32 step, with the wall time of its first two steps
(the compiles: one per precision and moment, or per precision for Adam, every chunk size alike)
over the eager optimizer's.

``--parts``: what each part of the codec costs inside the compiled call that steps an encoded Adam
piece whole (``GeomOptimizer(fuse=True)``), on one piece of 2¹⁸ entries, one thread: the call as it
is, then with the code search (int8-ec: and the corrections), the block scales and the decode (bf16:
the rounding) each replaced in turn by a cast of the same shapes (:data:`STAND_INS`), every row
compiled once and timed round-robin beside torch's fused AdamW on float32 state of as many entries;
each part's cost is the difference between neighbouring rows, in ns per entry (both moments). The
times are the calling thread's CPU time (``time.thread_time``), not the wall clock: on a shared
machine the wall clock counts the time other jobs held the core.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import emit, section_for  # noqa: E402
from state_quality import PRECISIONS, state_bytes  # noqa: E402

import geomopt  # noqa: E402
from geomopt.cli.bench import Timer, device_name, hidden_workload  # noqa: E402
from geomopt.optim.engine import fused_codec  # noqa: E402
from geomopt.optim.engine.workspace import Workspace  # noqa: E402
from geomopt.optim.persist import state_codec  # noqa: E402
from geomopt.optim.persist.codes import seed_of  # noqa: E402
from geomopt.optim.persist.state_codec import CHUNK, STORED, Codec, decode_piece  # noqa: E402
from geomopt.optim.units.state_keys import MOMENTS  # noqa: E402


def codec_pass(opt, dtype: str):
    """A call that decodes and encodes every encoded moment of ``opt``'s state once, chunk by chunk
    into the workspace (new stored entries made once, outside the call); None for float32."""
    if dtype == "float32":
        return None
    codec, ws = Codec(dtype, step=1), Workspace()
    moments = [(st, key) for st in opt.state.values() for key in MOMENTS
               if key in st and st[key].dtype == STORED[dtype]]
    device = moments[0][0][moments[0][1]].device
    outs = [codec.empty(key, st[key].numel(), device) for st, key in moments]
    Codec.reserve(ws.take, CHUNK, device)

    def run():
        for (st, key), out in zip(moments, outs):
            n = st[key].numel()
            for a in range(0, n, CHUNK):
                b = min(n, a + CHUNK)
                buf = ws.take("state", (b - a,), torch.float32, device)
                decode_piece(st, key, a, b, buf, ws.take)
                codec.encode_piece(key, buf, a, b, (1, n), [seed_of("t", 1, key)], out, ws.take)

    return run


def with_state(spec: str, dtype: str) -> dict:
    """The shipped spec ``spec`` with every rule's state in ``dtype``."""
    return {"geomopt": 1, "name": f"{Path(spec).stem}-{dtype}", "extends": spec, "defaults": {"state": dtype}}


def measure(spec: str, model: str, device: str, iters: int, fuse: bool = False) -> list[dict]:
    """One row per (precision, fuse): median step (ms), × float32's (default step; fuse=True's), the
    codec alone × float32's, state bytes per parameter, × float32's, the first two steps' wall time
    (s); a float32 A/A row."""
    _, fresh = hidden_workload(model, device, torch.float32)
    runs = [(d, False) for d in PRECISIONS] + [("float32 A/A", False)] + [(d, True) for d in PRECISIONS] * fuse
    opts, params, first = [], 0, {}
    for dtype, fused in runs:
        ps = fresh()
        params = sum(p.numel() for _, p in ps)
        opt = geomopt.GeomOptimizer(ps, with_state(spec, dtype.split()[0]), fuse=fused)
        t0 = time.perf_counter()
        for _ in range(2):
            opt.step()
        first[dtype, fused] = time.perf_counter() - t0
        opts.append(((dtype, fused), opt))
    timer = Timer(device)
    times: dict = {k: [] for k, _ in opts}
    codecs = {k: codec_pass(opt, k[0].split()[0]) if not k[1] else None for k, opt in opts}
    alone: dict = {k: [] for k, _ in opts}
    for k in range(iters):
        for key, opt in (opts if k % 2 == 0 else opts[::-1]):
            times[key] += timer(opt.step, 0, 1)
            if codecs[key] is not None:
                alone[key] += timer(codecs[key], 0, 1)
    ms = {k: statistics.median(t) for k, t in times.items()}
    codec_ms = {k: statistics.median(t) for k, t in alone.items() if t}  # eager rows only
    held = {k: state_bytes(opt) for k, opt in opts}
    base = ms["float32", False]
    return [dict(spec=spec, state=d, fuse=f, ms=ms[d, f], time_ratio=ms[d, f] / base,
                 fuse_ratio=ms[d, f] / ms["float32", True] if f else None,
                 codec_ratio=None if f else codec_ms.get((d, f), 0.0) / base, bytes_per_param=held[d, f] / params,
                 bytes_ratio=held[d, f] / held["float32", False], first_s=first[d, f]) for d, f in runs]


#: the codec's parts (state_codec's names) and the casts that stand in for them in :func:`parts`, each
#: of the same shapes and dtypes and no arithmetic to speak of, removed cumulatively in this order
STAND_INS = {
    "code search": {"nearest_codes": lambda scaled, signed, take=None: scaled.to(torch.int32),
                    "encode_correction": lambda scaled, codes, signed, bits, take=None: scaled.to(torch.uint8)},
    "block scales": {"block_scaled": lambda x, take=None, absmax=None: (x.reshape(-1), absmax)},
    "decode": {"decode_int8": lambda c, m, signed, take=None, out=None: out.view(c.shape).copy_(c),
               "decode_int8_ec": lambda c, t, m, signed, take=None, out=None: out.view(c.shape).copy_(c)},
    "rounding": {"encode_bf16": lambda x, bits, take=None, out=None: out.copy_(x)},
}
#: the parts each precision has
PARTS = {"int8": ("code search", "block scales", "decode"), "int8-ec": ("code search", "block scales", "decode"),
         "bfloat16": ("rounding",)}


@contextlib.contextmanager
def standing_in(names: dict):
    """state_codec's functions ``names`` replaced by their stand-ins (a compiled call guards on them: the
    same replacement must be in place when it runs)."""
    saved = {k: getattr(state_codec, k) for k in names}
    for k, fn in names.items():
        setattr(state_codec, k, fn)
    try:
        yield
    finally:
        for k, fn in saved.items():
            setattr(state_codec, k, fn)


def encoded_call(dtype: str, n: int):
    """The compiled call of an encoded Adam piece (fuse=True) on a tensor of ``n`` entries, with the
    arguments of its last call after three steps of a fresh optimizer, and a call that puts those
    arguments back as they were (the code search's cost depends on where the values fall in its
    table: every timed call starts from the same state)."""
    calls = []
    real = fused_codec.EncodedAdam.__call__

    def spy(self, *args):
        calls.append((self, args, [t.clone() for t in _tensors(args)]))
        return real(self, *args)

    spec = {"geomopt": 1, "name": "parts", "rules": [{"name": "all", "match": "**", "geometry": {"kind": "adam"},
                                                      "lr": 1e-3, "weight_decay": 0.1, "state": dtype}]}
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = geomopt.GeomOptimizer([("w", p)], spec, fuse=True)
    fused_codec.EncodedAdam.__call__ = spy
    try:
        for _ in range(3):
            p.grad = torch.randn(n, generator=gen) * 1e-3
            opt.step()
    finally:
        fused_codec.EncodedAdam.__call__ = real
    self, args, saved = calls[-1]

    def reset():
        for t, s in zip(_tensors(args), saved):
            t.copy_(s)

    return (lambda: self(*args)), reset


def _tensors(args) -> list:
    """The tensors an encoded Adam call writes: the parameter's piece and its moments' stored entries."""
    return [args[0], *(t for stored in args[2].values() for t in stored.values())]


def parts(iters: int, n: int = 1 << 18) -> list[dict]:
    """One row per (precision, parts left): the median compiled call (ms), in ns per entry, and over
    torch's fused AdamW (float32 state, ``n`` entries); the fused AdamW row first."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    adamw = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    adamw.step()
    state = [p.data, adamw.state[p]["exp_avg"], adamw.state[p]["exp_avg_sq"]]
    saved = [t.clone() for t in state]

    def reset():  # as the encoded calls' reset: the same state each time, the tensors it writes just copied
        for t, s in zip(state, saved):
            t.copy_(s)

    rows = [("float32", "torch fused AdamW", {}, (adamw.step, reset))]
    for dtype, names in PARTS.items():
        fused_codec._ADAM.clear()  # a compile of its own per row: a code object each
        removed: dict = {}
        for stage in ("whole", *(f"− {part}" for part in names)):
            if stage != "whole":
                removed = {**removed, **STAND_INS[stage[2:]]}
            with standing_in(removed):
                rows.append((dtype, stage, removed, encoded_call(dtype, n)))
            fused_codec._ADAM.clear()
    times: dict = {i: [] for i in range(len(rows))}
    with torch.no_grad():
        for k in range(iters + 2):
            for i in (range(len(rows)) if k % 2 == 0 else reversed(range(len(rows)))):
                call, reset = rows[i][3]
                with standing_in(rows[i][2]):
                    reset()
                    t0 = time.thread_time()  # this thread's CPU time: a busy machine's preemptions left out
                    call()
                    if k >= 2:
                        times[i].append(time.thread_time() - t0)
    base = statistics.median(times[0])
    return [dict(state=r[0], call=r[1], ms=statistics.median(times[i]) * 1e3,
                 ns=statistics.median(times[i]) / n * 1e9, ratio=statistics.median(times[i]) / base)
            for i, r in enumerate(rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--specs", nargs="+", default=["muon", "examples/adam-all"],
                   help="shipped spec names or paths (default: muon, examples/adam-all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fuse", action="store_true", help="every precision again under GeomOptimizer(fuse=True)")
    p.add_argument("--parts", action="store_true",
                   help="each codec part's cost inside the compiled encoded Adam call (one piece, one thread)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
    if args.parts:
        lines = [f"### The compiled encoded Adam call by parts: one piece of 2^18 entries, one thread, "
                 f"{device_name('cpu')}, torch {torch.__version__} — {datetime.date.today().isoformat()}", "",
                 "| state | call | ms (median) | ns per entry | × fused AdamW |", "|---|---|---|---|---|"]
        lines += [f"| {r['state']} | {r['call']} | {r['ms']:.3f} | {r['ns']:.2f} | {r['ratio']:.2f} |"
                  for r in parts(args.iters)]
        emit("\n".join(lines), args.record, "State precision")
        return 0
    root = Path(__file__).resolve().parents[1] / "specs"
    rows = []
    for spec in args.specs:
        path = spec if spec in geomopt.shipped_specs() or Path(spec).exists() else str(root / f"{spec}.yaml")
        rows += measure(path, args.model, args.device, args.iters, args.fuse)
    lines = [f"### State precision's step time and bytes: {args.model}'s hidden matrices, "
             f"{device_name(args.device)}, torch {torch.__version__} — {datetime.date.today().isoformat()}", "",
             "| spec, state | step (ms, median) | × float32 state | codec alone, × float32 state's step "
             "| state bytes per parameter | × float32 state |"
             + " × float32 state, fuse | first two steps (s) |" * args.fuse,
             "|---|---|---|---|---|---|" + "---|---|" * args.fuse]
    for r in rows:
        name = f"{Path(r['spec']).stem}, {r['state']}" + ", fuse" * r["fuse"]
        codec = "–" if r["codec_ratio"] is None else f"{r['codec_ratio']:.3f}"  # fuse: the eager codec's row
        line = (f"| {name} | {r['ms']:.2f} | {r['time_ratio']:.3f} | {codec} | "
                f"{r['bytes_per_param']:.3f} | {r['bytes_ratio']:.3f} |")
        if args.fuse:
            line += f" {'' if r['fuse_ratio'] is None else format(r['fuse_ratio'], '.3f')} | {r['first_s']:.2f} |"
        lines.append(line)
    emit("\n".join(lines), args.record, section_for(args.device, "State precision"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
