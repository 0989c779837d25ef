"""Run by tests/test_state_layouts.py under ``torchrun --nproc_per_node 4`` (gloo, CPU): optimizer
state kept in bfloat16, int8 and int8-ec under DDP, FSDP2, HSDP and FSDP2 × TP (tests/layout_worker.py's
4-process world), against one process.

An HF Llama of width 512 (intermediate 1024): every layout cuts each tensor's last dim at
multiples of 256, so int8 blocks lie within shards and each layout stores what one process
stores (bf16 rounding noise is a hash of each entry's place in the whole tensor). At width 256
the row-wise o_proj under FSDP2 × TP (in 256, cut into halves of 128) and the final norm cannot
hold whole blocks and keep float32 state on every rank: the checkpoint round trips run there, on
a state of both kinds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distributed_worker import finish
from geomopt import GeomOptimizer
from geomopt.optim.units.state_keys import SIDE
from layout_worker import CFG, World, make_model, params_of, round_trips, train

WIDE = dict(CFG, hidden_size=512, intermediate_size=1024)
MIXED_FORMATS = dict(CFG, hidden_size=256, intermediate_size=512)
#: spec name → its state precision: each shipped base in bfloat16 and int8, and muon in int8-ec
DTYPES = {f"{base}-{dtype}": dtype for base in ("muon", "adamw-hybrid") for dtype in ("bfloat16", "int8")}
DTYPES["muon-int8-ec"] = "int8-ec"
SPECS = {name: {"geomopt": 1, "name": name, "extends": name.removesuffix(f"-{dtype}"), "defaults": {"state": dtype}}
         for name, dtype in DTYPES.items()}
LAYOUTS = ("ddp", "fsdp", "hsdp", "fsdp_tp")


def entries(opt, model) -> dict:
    """Per parameter: each state entry's dtype, and the placements of its int8 block scales and
    int8-ec corrections."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {k: str(v.dtype).removeprefix("torch.") + (f" {tuple(v.placements)}" if k.endswith(SIDE)
                                                               and hasattr(v, "placements") else "")
                     for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor) and v.ndim > 0}
    return out


def held(opt) -> int:
    """Bytes of this rank's optimizer state (local shards)."""
    return sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
               for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = World()
    t0 = time.perf_counter()
    out: dict = {"rank": world.rank, "deviation": {}, "entries": {}, "held": {}}
    ref = {}
    for name, spec in SPECS.items():
        model = make_model(cfg=WIDE)
        opt = GeomOptimizer(model, spec, distributed=False)
        train(model, opt)
        ref[name] = params_of(model)
        out["entries"][("single", name)] = entries(opt, model)
    for layout in LAYOUTS:
        for name, spec in [*SPECS.items(), *(("muon-float32", "muon"),) * (layout == "fsdp")]:
            model, forward, kw = world.wrap(layout, make_model(cfg=WIDE))
            opt = GeomOptimizer(model, spec, **kw)
            train(model, opt, forward=forward)
            out["held"][(layout, name)] = held(opt)
            if name in ref:
                got = params_of(model)
                out["deviation"][(layout, name)] = max(float((got[k] - ref[name][k]).norm() / ref[name][k].norm())
                                                       for k in got)
                out["entries"][(layout, name)] = entries(opt, model)
    model, forward, kw = world.wrap("fsdp_tp", make_model(cfg=MIXED_FORMATS))
    opt = GeomOptimizer(model, SPECS["muon-int8"], **kw)
    train(model, opt, range(1), forward)
    out["entries"][("fsdp_tp", "mixed formats")] = entries(opt, model)
    out["round_trips"] = round_trips(world, ("fsdp_tp", "hsdp"), [(n, SPECS[n]) for n in (
        "muon-int8", "adamw-hybrid-bfloat16", "muon-int8-ec")], cfg=MIXED_FORMATS)
    out["seconds"] = time.perf_counter() - t0
    finish(out, out_dir / f"rank{world.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
