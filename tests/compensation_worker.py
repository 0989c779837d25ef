"""Run by tests/test_compensation.py under ``torchrun --nproc_per_node 4`` (gloo, CPU): a bf16 HF
Llama with compensated weights under DDP (tests/layout_worker.py's 4-process world: two DDP
pairs), against one process (sharded parameters: tests/compensation_fsdp_worker.py).

Every rank sees the same batch, so the data-parallel bf16 gradients are the one-process ones; the
step runs on the decoded float32 weights and stores them back into the parameters' own storage,
which DDP keeps. Reported per spec: the largest relative difference of the bf16 weights and of
the decoded float32 weights from one process's, the loss of a forward after the steps, each
error's dtype.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distributed_worker import finish
from geomopt import GeomOptimizer
from geomopt.optim.units.compensation import JOIN
from layout_worker import World, batch, make_model, train

LAYOUTS = ("ddp",)
SPECS = {f"{base}-{form}": {"geomopt": 1, "name": f"{base}-{form}", "extends": base,
                            "defaults": {"state": {"dtype": "float32", "compensation": form}}}
         for base, form in (("muon", "int16"), ("adamw-hybrid", "int8"))}


def weights(model, opt, form: str) -> dict:
    """Per parameter: (the bf16 weight, the decoded float32 weight)."""
    out = {}
    for name, p in model.named_parameters():
        w = p.detach()
        err = opt.state.get(p, {}).get("weight_error")
        out[name] = (w.clone(), w.float() if err is None else JOIN[form](w, err))
    return out


def next_loss(forward) -> float:
    with torch.no_grad():
        ids = batch(99)
        return float(forward(input_ids=ids, labels=ids).loss)


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = World()
    t0 = time.perf_counter()
    out: dict = {"rank": world.rank, "deviation": {}, "loss": {}, "errors": {}}
    ref = {}
    for name, spec in SPECS.items():
        form = name.rsplit("-", 1)[1]
        model = make_model().to(torch.bfloat16)
        opt = GeomOptimizer(model, spec, distributed=False)
        train(model, opt)
        ref[name] = weights(model, opt, form)
        out["loss"][("single", name)] = next_loss(model)
    for layout in LAYOUTS:
        for name, spec in SPECS.items():
            form = name.rsplit("-", 1)[1]
            model, forward, kw = world.wrap(layout, make_model().to(torch.bfloat16))
            opt = GeomOptimizer(model, spec, **kw)
            train(model, opt, forward=forward)
            got = weights(model, opt, form)
            out["deviation"][(layout, name)] = {
                part: max(float((got[k][i].float() - ref[name][k][i].float()).norm()
                                / ref[name][k][i].float().norm()) for k in got)
                for i, part in enumerate(("bf16", "float32"))}
            out["loss"][(layout, name)] = next_loss(forward)
            out["errors"][(layout, name)] = {n: (str(e.dtype), str(p.dtype)) for n, p in model.named_parameters()
                                             if (e := opt.state.get(p, {}).get("weight_error")) is not None}
    out["seconds"] = time.perf_counter() - t0
    finish(out, out_dir / f"rank{world.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
