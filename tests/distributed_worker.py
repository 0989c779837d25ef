"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node 2`` (gloo, CPU).

Every scenario trains a small GPT for a few steps on the same batches as a single-process
reference (the optimizer built with ``distributed=False`` in this same process), then each rank
saves what the tests assert on to ``<out>/rank<r>.pt``. Both ranks see the same batch, so the
gradients equal the reference's bit for bit and every difference is the optimizer's."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from geomopt import GeomOptimizer
from geomopt.models.gpt import GPT, GPTConfig
from geomopt.cli.demo import SPECS_DIR


def spec_path(name: str) -> Path:
    return SPECS_DIR / f"{name}.yaml"

STEPS = 3
SHIPPED = ["muon", "uscion", "spectral-clip", "prox-muon-frobenius", "hyperball", "stiefel", "scion",
           "sign-descent", "normalized-sgd", "adamw-hybrid"]

# every locality class of every operator family that the shipped specs leave out
MIXED = {
    "geomopt": 1, "name": "mixed",
    "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.2}},
    "rules": [
        {"name": "wte", "match": "transformer.wte.weight",
         "geometry": {"kind": "rowwise", "reference": {"kind": "log_barrier", "eps": 1e-8}},
         "constraint": {"kind": "frobenius_ball", "radius": 2.0}},
        {"name": "wpe", "match": "transformer.wpe.weight", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "l0", "k": 200}},
        {"name": "qkv", "match": "**.c_attn.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                      "layout": "in_out"},
         "constraint": {"kind": "rank", "k": 8}},
        # layout in_out: the operators see the transpose, so the shard dim moves (owner path)
        {"name": "attn_out", "match": "**.attn.c_proj.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 2e-3},
                      "approx": {"kind": "polar_express", "steps": 6}, "layout": "in_out"},
         "constraint": {"kind": "spectral_sphere", "radius": 1.0}},
        {"name": "fc", "match": "**.c_fc.weight",
         "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
         "constraint": {"kind": "frobenius_sphere", "radius": 3.0}},
        {"name": "mlp_out", "match": "**.mlp.c_proj.weight",
         "geometry": {"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}},
         "constraint": {"kind": "l2_ball", "radius": 1.5}},
        {"name": "head", "match": "lm_head.weight", "geometry": {"kind": "adam"}, "weight_decay": 0.1},
        {"name": "ln_f", "match": "transformer.ln_f.*", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "proximal_decay", "lam": 0.1}},
        {"name": "ln", "match": "**.ln_*.weight", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "linf_sphere", "radius": 1.0}},
        # a smooth reference: the key bias's gradient is rounding noise (softmax ignores it), whose
        # sign an indicator would turn into a full step
        {"name": "bias", "match": "**.bias",
         "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
         "constraint": {"kind": "linf_ball", "radius": 0.05}},
    ],
}


# every post-stage (each second-moment axis, norm_ratio's and trust_ratio's per-tensor sums over the shards (the
# latter's of the parameter's shards too), axis_norm's row and
# column sums, contra's power iteration; rows and columns cut across ranks by FSDP2's Shard(0),
# the in_out projection with its columns cut), cautious decay and the heavy-ball and Lion directions
STAGED = {
    "geomopt": 1, "name": "staged",
    "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True, "warmup_steps": 2,
                                           "warmup_alpha": 0.3}},
    "rules": [
        {"name": "qkv", "match": "**.c_attn.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"},
                      "layout": "in_out"},
         "post": [{"kind": "second_moment", "axis": "row"}, {"kind": "dual_scale"}, {"kind": "rms_match", "target": "input"},
                  {"kind": "cautious"}],
         "weight_decay": 0.1, "decay": "cautious"},
        {"name": "fc", "match": "**.c_fc.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}},
         "post": [{"kind": "second_moment", "axis": "column"}, {"kind": "axis_norm", "order": ["row", "column"]},
                  {"kind": "rms_match", "target": 0.2}],
         "direction": {"kind": "heavy_ball", "momentum": 0.9, "nesterov": True}},
        {"name": "proj", "match": "**.c_proj.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
         "post": [{"kind": "contra", "coeff": 0.5},
                  {"kind": "second_moment", "axis": "element", "bias_correction": True},
                  {"kind": "rms_match", "target": "polar"}]},
        {"name": "head", "match": "lm_head.weight", "geometry": {"kind": "adam"},
         "post": [{"kind": "cautious"}, {"kind": "trust_ratio", "weight_decay": 0.01, "eps": 1e-6}],
         "weight_decay": 0.1, "decay": "cautious"},
        # Lion's direction under a smooth reference (not the sign): the attention key bias's gradient is
        # rounding noise, which shards round their own way and a sign (or a cautious mask, which reads
        # the gradient's sign) would turn into full steps
        {"name": "rest", "match": "**",
         "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
         "direction": {"kind": "lion"}, "lr": 1e-3, "post": [{"kind": "norm_ratio", "beta2": 0.9}]},
    ],
}


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    # dims chosen so that Shard(0) splits some tensors unevenly (vocab 97, 3·24 = 72 rows)
    return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=24))


def batches(n: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 97, (4, 17), generator=g) for _ in range(n)]


def train(model, opt, data):
    for idx in data:
        opt.zero_grad(set_to_none=True)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()


def train_ddp(model, opt, data):
    """:func:`train` through torch's DistributedDataParallel, which averages the gradients (the
    optimizer shares out the matrix functions)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    for idx in data:
        opt.zero_grad(set_to_none=True)
        logits = ddp(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()


def params_of(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def spec_of(name):
    return MIXED if name == "mixed" else spec_path(name)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result: dict = {"world": dist.get_world_size(), "ref": {}, "ddp": {}, "fsdp": {}, "work": {}}
    data = batches(STEPS)
    for name in SHIPPED + ["mixed"]:
        spec = spec_of(name)
        ref = make_model()
        ref_opt = GeomOptimizer(ref, spec, distributed=False)
        train(ref, ref_opt, data)
        result["ref"][name] = params_of(ref)
        ref_flops = ref_opt.work.flops

        # DDP: torch's DistributedDataParallel averages the gradients; the optimizer shares out
        # the matrix functions
        model = make_model()
        opt = GeomOptimizer(model, spec)
        train_ddp(model, opt, data)
        result["ddp"][name] = params_of(model)
        result["work"][name] = dict(ddp=opt.work.flops, ref=ref_flops, kind=type(opt.engine.executor).__name__)

        # FSDP2
        model = shard(make_model())
        opt = GeomOptimizer(model, spec)
        train(model, opt, data)
        result["fsdp"][name] = params_of(model)
        result["work"][name].update(fsdp=opt.work.flops, fsdp_kind=type(opt.engine.executor).__name__)
    result["staged"] = staged(data)
    result["checkpoint"] = checkpoint_round_trip(data)
    result["dcp"] = dcp_round_trip(data)
    result["dcp_staged"] = dcp_round_trip(data, STAGED)
    result["errors"] = bad_input()
    result["nonfinite"] = nonfinite_on_one_rank()
    finish(result, out / f"rank{rank}.pt")


def staged(data) -> dict:
    """:data:`STAGED` under DDP and FSDP2 against one process, and its FSDP2 checkpoint: state
    saved after 2 steps and loaded into a fresh optimizer resumes exactly."""
    from torch.distributed.tensor import DTensor

    ref = make_model()
    train(ref, GeomOptimizer(ref, STAGED, distributed=False), data)
    model = make_model()
    opt = GeomOptimizer(model, STAGED)
    train_ddp(model, opt, data)
    out = dict(ref=params_of(ref), ddp=params_of(model), kind=type(opt.engine.executor).__name__,
               state=sorted({k for st in opt.state.values() for k in st}))

    model = shard(make_model())
    opt = GeomOptimizer(model, STAGED)
    train(model, opt, data[:2])
    out["fsdp_kind"] = type(opt.engine.executor).__name__
    out["fsdp_state_is_dtensor"] = all(isinstance(v, DTensor) for st in opt.state.values() for k, v in st.items()
                                       if k == "post_v")
    saved_model, saved_opt = _clone(model.state_dict()), _clone(opt.state_dict())
    train(model, opt, data[2:])
    out["fsdp"] = params_of(model)
    fresh = shard(make_model(seed=7))
    fresh.load_state_dict(saved_model)
    fresh_opt = GeomOptimizer(fresh, STAGED)
    fresh_opt.load_state_dict(saved_opt)
    train(fresh, fresh_opt, data[2:])
    got = params_of(fresh)
    out["fsdp_resume_diff"] = max(float((out["fsdp"][k] - got[k]).abs().max()) for k in got)
    return out


def save_dcp(model, opt) -> str:
    """Save ``model`` and ``opt`` with torch.distributed.checkpoint into a fresh folder that rank 0
    names and every rank is told; its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    path = [tempfile.mkdtemp(prefix="geomopt-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    return path[0]


def snapshot(model, opt) -> tuple[dict, dict, str]:
    """(a copy of ``model``'s state dict, a copy of ``opt``'s, the folder :func:`save_dcp` saved both in)."""
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return saved_model, _clone(opt.state_dict()), save_dcp(model, opt)


def load_dcp(model, opt, path: str) -> None:
    """Load what :func:`save_dcp` saved in ``path`` into ``model`` and ``opt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def finish(result: dict, path: Path) -> None:
    """Save this rank's ``result`` at ``path``, wait for every rank, and leave the process group."""
    torch.save(result, path)
    dist.barrier()
    dist.destroy_process_group()


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def checkpoint_round_trip(data) -> dict:
    """opt.state_dict() under FSDP2: same keys on every rank, DTensor state sharded like the
    parameters; loading it into a fresh optimizer resumes exactly."""
    from torch.distributed.tensor import DTensor

    model = shard(make_model())
    opt = GeomOptimizer(model, spec_path("uscion"))
    train(model, opt, data[:2])
    sd = opt.state_dict()
    keys = sorted((pid, k) for pid, st in sd["state"].items() for k in st)
    sharded_like_params = all(
        isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape
        for p, st in ((p, opt.state[p]) for g in opt.param_groups for p in g["params"])
        for k, v in st.items() if isinstance(v, torch.Tensor) and v.ndim > 0)
    saved_model = _clone(model.state_dict())
    saved_opt = _clone(sd)
    train(model, opt, data[2:])
    expected = params_of(model)

    fresh = shard(make_model(seed=7))
    fresh.load_state_dict(saved_model)
    fresh_opt = GeomOptimizer(fresh, spec_path("uscion"))
    fresh_opt.load_state_dict(saved_opt)
    train(fresh, fresh_opt, data[2:])
    got = params_of(fresh)
    diff = max(float((expected[k] - got[k]).abs().max()) for k in expected)
    return dict(keys=keys, diff=diff, sharded_like_params=sharded_like_params)


def dcp_round_trip(data, spec=None) -> dict:
    """torch.distributed.checkpoint save / load of model and optimizer (FQN-keyed state)."""
    spec = spec_path("spectral-clip") if spec is None else spec
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = shard(make_model())
    opt = GeomOptimizer(model, spec)
    train(model, opt, data[:2])
    keys = sorted(get_state_dict(model, opt)[1]["state"])
    path = save_dcp(model, opt)
    train(model, opt, data[2:])
    expected = params_of(model)

    fresh = shard(make_model(seed=7))
    fresh_opt = GeomOptimizer(fresh, spec)
    load_dcp(fresh, fresh_opt, path)
    train(fresh, fresh_opt, data[2:])
    got = params_of(fresh)
    diff = max(float((expected[k] - got[k]).abs().max()) for k in expected)
    return dict(keys=keys, diff=diff)


def nonfinite_on_one_rank() -> dict:
    """A NaN in rank 1's shard only: every rank skips the step, nothing is written."""
    model = shard(make_model())
    opt = GeomOptimizer(model, spec_path("spectral-clip"))
    train(model, opt, batches(1))
    before = params_of(model)
    opt.zero_grad(set_to_none=True)
    idx = batches(2)[1]
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    if dist.get_rank() == 1:
        model.transformer.h[0].mlp.c_fc.weight.grad.to_local()[0, 0] = float("nan")
    opt.step()
    after = params_of(model)
    skipped = {rule: d["skipped"] for rule, d in opt.diagnostics().items()}
    return dict(unchanged=all(torch.equal(before[k], after[k]) for k in before), skipped=skipped)


def bad_input() -> dict:
    """Errors users can make: a sharded checkpoint loaded at another world size, and forcing DDP
    on FSDP2 parameters."""
    out = {}
    model = shard(make_model())
    opt = GeomOptimizer(model, spec_path("uscion"))
    train(model, opt, batches(1))
    sd = opt.state_dict()
    sd["geomopt"]["world_size"] = 4
    try:
        opt.load_state_dict(sd)
        out["world_size"] = None
    except ValueError as e:
        out["world_size"] = str(e)
    try:
        GeomOptimizer(model, spec_path("uscion"), distributed="ddp")
        out["ddp_on_dtensor"] = None
    except ValueError as e:
        out["ddp_on_dtensor"] = str(e)
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
