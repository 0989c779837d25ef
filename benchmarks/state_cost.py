"""What each state precision costs per step and holds per parameter, in one process: a spec's
optimizer with its state in float32, bfloat16, int8 and int8-ec stepping copies of the same
tensors (the hidden matrices of ``--model``, each with the same fixed gradient), round-robin with
the order reversed every round (benchmarks/ab.py's method: the machine's drift hits every row
alike).

    python benchmarks/state_cost.py [--model gpt-bench] [--specs muon examples/adam-all] [--iters 20]
                                    [--device cpu] [--fuse] [--record NOTE]

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
"""

from __future__ import annotations

import argparse
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
from geomopt.optim.engine.workspace import Workspace  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-bench")
    p.add_argument("--specs", nargs="+", default=["muon", "examples/adam-all"],
                   help="shipped spec names or paths (default: muon, examples/adam-all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fuse", action="store_true", help="every precision again under GeomOptimizer(fuse=True)")
    p.add_argument("--record", metavar="NOTE", help="record the table in benchmarks/RESULTS.md with this note")
    args = p.parse_args(argv)
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
