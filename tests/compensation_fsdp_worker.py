"""Run by tests/test_compensation.py under ``torchrun --nproc_per_node 4`` (gloo, CPU): compensated
bf16 weights on sharded (DTensor) parameters, in tests/layout_worker.py's world: ``fsdp`` (FSDP2
with bf16 parameters on two meshes of 2 ranks), ``hsdp`` (a 2 × 2 mesh: Replicate × Shard) and
``fsdp_tp`` (FSDP2 × TP on a 2 × 2 mesh). The embedding's and the head's 97 rows are cut unevenly
(49 + 48).

Per layout and spec, a bf16 model with the compensated spec and a float32 model holding the same
(bf16) weights with the spec as it ships, laid out alike and fed the same gradients (the bf16
model's, from its own forward through FSDP2's all-gather of the written-back shards): the
largest difference of the decoded float32 weights from the float32 model's, on this rank's
shards, relative to the bound the form allows. Then a distributed checkpoint (DCP) of a
compensated run resumes bit for bit, and a NaN gradient on one rank changes no bit of any
weight or error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import geomopt
from distributed_worker import finish, load_dcp, snapshot
from geomopt import GeomOptimizer
from geomopt.optim.units.compensation import JOIN
from layout_worker import World, batch, make_model, params_of

LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
STEPS = 3
BF16 = torch.bfloat16


def spec(base: str, form: str = "none", state: str = "float32") -> geomopt.Spec:
    """The shipped spec ``base`` with every rule's state in ``state`` and compensation ``form``."""
    data = geomopt.load_spec(base).model_dump(exclude_none=True)
    data["defaults"] = dict(data.get("defaults") or {},
                            state={"dtype": state} if form == "none" else {"dtype": state, "compensation": form})
    for rule in data["rules"]:
        rule.pop("state", None)
    return geomopt.Spec.model_validate(data)


def shard(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def decoded(model, opt, form: str) -> dict:
    """Per parameter, this rank's shard of the float32 weight: the bf16 shard and its error."""
    return {n: JOIN[form](shard(p).detach(), shard(opt.state[p]["weight_error"])) for n, p in model.named_parameters()}


def step_pair(m16, f16, o16, m32, o32, step: int) -> None:
    """One step of both models on the bf16 model's gradient (the float32 one gets it upcast)."""
    o16.zero_grad(set_to_none=True)
    ids = batch(step)
    f16(input_ids=ids, labels=ids).loss.backward()
    for p16, p32 in zip(m16.parameters(), m32.parameters()):
        p32.grad = p16.grad.float()
    o16.step()
    o32.step()


def against_float32(world: World) -> dict:
    """(layout, base, form) → the largest |x̂ − x| of the decoded weights against the float32
    model's over this rank's shards, ÷ the form's bound (int16: 0, reported as the difference
    itself; int8: STEPS · max|x| · 2^−16 per parameter); whether every error is a DTensor sharded
    like its parameter, of the form's dtype; the loss of a forward after the steps and of one
    process holding the gathered bf16 weights."""
    out = {}
    for layout in LAYOUTS:
        for base, form in (("muon", "int16"), ("adamw-hybrid", "int16"), ("muon", "int8"), ("adamw-hybrid", "int8")):
            m16, f16, kw = world.wrap(layout, make_model().to(BF16))
            m32, _, _ = world.wrap(layout, make_model().to(BF16).float())
            o16 = GeomOptimizer(m16, spec(base, form), **kw)
            o32 = GeomOptimizer(m32, spec(base), **kw)
            for step in range(STEPS):
                step_pair(m16, f16, o16, m32, o32, step)
            got = decoded(m16, o16, form)
            ref = {n: shard(p).detach() for n, p in m32.named_parameters()}
            if form == "int16":
                dev = max(float((got[n] - ref[n]).abs().max()) if ref[n].numel() else 0.0 for n in ref)
                bits = all(torch.equal(got[n].view(torch.int32), ref[n].view(torch.int32)) for n in ref)
            else:
                dev = max(float((got[n] - ref[n]).abs().max() / (STEPS * ref[n].abs().max() * 2.0 ** -16))
                          for n in ref if ref[n].numel())
                bits = False
            errors = [opt_err for p in m16.parameters() if (opt_err := o16.state[p].get("weight_error")) is not None]
            sharded = len(errors) == len(list(m16.parameters())) and all(
                type(e).__name__ == "DTensor" and e.placements == p.placements and e.shape == p.shape
                and e.dtype == getattr(torch, form) and shard(e).shape == shard(p).shape
                for e, p in zip(errors, m16.parameters()))
            with torch.no_grad():
                ids = batch(99)
                loss = float(f16(input_ids=ids, labels=ids).loss)
                whole = make_model().to(BF16)
                whole.load_state_dict(params_of(m16))
                one = float(whole(input_ids=ids, labels=ids).loss)
            out[(layout, base, form)] = dict(dev=dev, bits=bits, sharded=sharded, loss=loss, one_process=one,
                                             bf16=all(p.dtype == BF16 for p in m16.parameters()))
    return out


def everything(model, opt) -> dict:
    """The whole bf16 weights and errors (gathered), by name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().detach().clone()
        out[name + ":error"] = opt.state[p]["weight_error"].full_tensor().clone()
    return out


def train(model, forward, opt, steps) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        ids = batch(step)
        forward(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def checkpoints(world: World) -> dict:
    """Per layout: opt.state_dict() into a fresh optimizer, and a DCP save / load of model and
    optimizer (int8 compensation, bf16 state), resume bit for bit, errors included; a spec change
    (another lr) carries every error, sharded as it was."""

    out = {}
    the_spec = spec("muon", "int8", state="bfloat16")
    for layout in LAYOUTS:
        model, forward, kw = world.wrap(layout, make_model().to(BF16))
        opt = GeomOptimizer(model, the_spec, **kw)
        train(model, forward, opt, range(2))
        saved_model, saved_opt, path = snapshot(model, opt)
        train(model, forward, opt, range(2, 4))
        expected = everything(model, opt)
        data = the_spec.model_dump(exclude_none=True)
        data["defaults"]["lr"] = data["defaults"].get("lr", 0.02) / 2
        changed = GeomOptimizer(model, geomopt.Spec.model_validate(data), **kw)
        report = changed.load_state_dict(opt.state_dict(), allow_spec_change=True)
        carried = sum("compensation" in kinds for kinds in report.kept.values()) == len(expected) // 2 and all(
            type(e).__name__ == "DTensor" and e.placements == p.placements and torch.equal(shard(e), shard(o))
            for p in model.parameters()
            for e, o in ((changed.state[p]["weight_error"], opt.state[p]["weight_error"]),))

        fresh, fwd, kw = world.wrap(layout, make_model(seed=7).to(BF16))
        fresh.load_state_dict(saved_model)
        fresh_opt = GeomOptimizer(fresh, the_spec, **kw)
        fresh_opt.load_state_dict(saved_opt)
        train(fresh, fwd, fresh_opt, range(2, 4))
        got = everything(fresh, fresh_opt)

        via_dcp, fwd, kw = world.wrap(layout, make_model(seed=7).to(BF16))
        dcp_opt = GeomOptimizer(via_dcp, the_spec, **kw)
        load_dcp(via_dcp, dcp_opt, path)
        train(via_dcp, fwd, dcp_opt, range(2, 4))
        got_dcp = everything(via_dcp, dcp_opt)
        same = {k: torch.equal(expected[k].view(torch.uint8), got[k].view(torch.uint8)) for k in expected}
        same_dcp = {k: torch.equal(expected[k].view(torch.uint8), got_dcp[k].view(torch.uint8)) for k in expected}
        out[layout] = dict(state_dict=all(same.values()), dcp=all(same_dcp.values()), keys=len(expected),
                           carried=carried,
                           moved=sum(bool(expected[k + ":error"].any()) for k, _ in model.named_parameters()))
    return out


def nonfinite(world: World) -> dict:
    """A NaN in one rank's shard of one gradient (the last rank of each training: ``fsdp`` trains
    on two meshes, {0, 1} and {2, 3}): every rank skips the step; no bit of a weight's shard or of
    an error moves, and each parameter keeps its own gradient."""
    out = {}
    for layout in LAYOUTS:
        model, forward, kw = world.wrap(layout, make_model().to(BF16))
        opt = GeomOptimizer(model, spec("muon", "int8"), **kw)
        train(model, forward, opt, range(1))
        before = {n: (shard(p).detach().clone(), shard(opt.state[p]["weight_error"]).clone())
                  for n, p in model.named_parameters()}
        opt.zero_grad(set_to_none=True)
        ids = batch(5)
        forward(input_ids=ids, labels=ids).loss.backward()
        if dist.get_rank() in ((1, 3) if layout == "fsdp" else (3,)):
            shard(model.model.layers[0].mlp.down_proj.weight.grad)[0, 0] = float("nan")
        grads = [p.grad for p in model.parameters()]
        opt.step()
        out[layout] = dict(
            unchanged=all(torch.equal(before[n][0].view(torch.int16), shard(p).detach().view(torch.int16))
                          and torch.equal(before[n][1], shard(opt.state[p]["weight_error"]))
                          for n, p in model.named_parameters()),
            own_grads=all(p.grad is g and p.dtype == BF16 for p, g in zip(model.parameters(), grads)),
            skipped={rule: d["skipped"] for rule, d in opt.diagnostics().items()})
    return out


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = World()
    t0 = time.perf_counter()
    out: dict = {"rank": world.rank, "against_float32": against_float32(world), "checkpoints": checkpoints(world),
                 "nonfinite": nonfinite(world)}
    out["seconds"] = time.perf_counter() - t0
    finish(out, out_dir / f"rank{world.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
