"""Run by tests/test_expert_parallel.py under ``torchrun --nproc_per_node 4`` (gloo, CPU).

Layout ``fsdp_ep``, torchtitan's expert parallelism for MoE: a small MoE transformer (names as
torchtitan's: ``tok_embeddings``, ``layers.i.attention.wq``, ``layers.i.moe.router.gate``,
``layers.i.moe.experts.w1`` (E, hidden, dim), ``layers.i.moe.shared_experts.w1`` ...) whose experts
are 3-D weights, each expert a matrix. Meshes as torchtitan's ``ParallelDims(dp_shard=4, ep=2)``
builds them: the dense mesh ``dp_shard`` (all 4 ranks) and the sparse mesh (``efsdp`` 2 × ``ep``
2). The placement calls are torchtitan's (``torchtitan/distributed/fsdp.py``,
``models/common/moe_sharding.py``): routed experts ``Shard(0)`` over ``ep``, then FSDP2 over
``efsdp`` (``Shard(0)`` when efsdp × ep ≤ E, ``Shard(1)`` when efsdp × ep > E, torchtitan's rule);
everything else (router, shared experts, attention, embeddings, norms, head) FSDP2 on
``dp_shard``. So experts and dense parameters live on different meshes. The model is this
module's rather than torchtitan's because torchtitan 0.3's MoE modules run their token dispatch
through its ``spmd_types`` / full-DTensor machinery, which does not run on gloo CPU processes.

Gradients: the EP forward (token all-to-all) is not the optimizer's business. Each step, the
parameters are gathered whole (``full_tensor()``), ONE process computes the gradient of the
whole model on the step's fixed batch (a real forward / backward), and every distributed
parameter gets its gradient laid out by torch's own sharding: a second, identically parallelized
model takes the full gradients through ``set_model_state_dict(full_state_dict=True)`` and each
parameter's ``.grad`` is that model's local shard with the parameter's mesh and placements.

Layouts: ``fsdp_ep`` (E = 8: each rank holds 2 whole experts of each weight: (_StridedShard(0),
Shard(0)) on the sparse mesh) and ``fsdp_ep_rows`` (E = 2 < efsdp × ep: FSDP2 cuts the experts'
rows, ``Shard(1)``, so owner operators gather them).

Each rank saves ``rank{r}.pt``: ``ref`` {spec: {"params", "flops"}} (the one-process reference of
the fsdp_ep model, this rank's share of the specs; ``ref_rows`` the same for fsdp_ep_rows' model),
``fsdp_ep`` / ``fsdp_ep_rows`` {spec: {name: full tensor}} (rank 0), ``sent`` {layout: {spec: bytes
this rank sends in one step / parameter bytes}}, ``work`` {layout: {spec: matrix FLOPs}},
``refused`` {layout: {spec: message}}, ``placements`` {layout: {name: str(placements)}},
``meshes`` {layout: {name: mesh dim names}}, ``round_trips`` {spec: {state_dict, dcp, moved}}.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _layouts import _counter  # noqa: E402
from distributed_worker import finish, load_dcp, snapshot  # noqa: E402
from geomopt import GeomOptimizer, shipped_specs  # noqa: E402

STEPS = 2
DIM, HIDDEN, VOCAB, LAYERS = 16, 24, 37, 2
NS = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}
EXPERT_VIEW = {"kind": "matrix", "batch": 1}

# every operator locality (owner: SVD, polar, rank, Stiefel, spectral sphere / ball, top-k; reduce:
# isotropic, rowwise, Frobenius / ℓ2 balls and spheres; local: anisotropic, adam, ℓ∞, prox) on this
# model's names, the experts among them (each expert a matrix)
MIXED = {
    "geomopt": 1, "name": "mixed_ep",
    "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.2}},
    "rules": [
        {"name": "embed", "match": "tok_embeddings.weight",
         "geometry": {"kind": "rowwise", "reference": {"kind": "log_barrier", "eps": 1e-8}},
         "constraint": {"kind": "frobenius_ball", "radius": 2.0}},
        {"name": "w1", "match": "**.moe.experts.w1",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                      "view": EXPERT_VIEW},
         "constraint": {"kind": "rank", "k": 4}},
        {"name": "w2", "match": "**.moe.experts.w2",
         "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 2e-3},
                      "approx": {"kind": "polar_express", "steps": 6}, "view": EXPERT_VIEW},
         "constraint": {"kind": "spectral_sphere", "radius": 1.0}},
        {"name": "w3", "match": "**.moe.experts.w3", "geometry": {**NS, "view": EXPERT_VIEW},
         "constraint": {"kind": "spectral_ball", "radius": 1.0}},
        {"name": "wq", "match": "**.attention.wq.weight",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}},
         "constraint": {"kind": "stiefel"}},
        {"name": "wo", "match": "**.attention.wo.weight", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "l0", "k": 100}},
        {"name": "router", "match": "**.moe.router.gate.weight",
         "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
         "constraint": {"kind": "frobenius_sphere", "radius": 3.0}},
        {"name": "shared_in", "match": r"re:.*\.shared_experts\.w[13]\.weight",
         "geometry": {"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}},
         "constraint": {"kind": "l2_ball", "radius": 1.5}},
        {"name": "shared_out", "match": "**.shared_experts.w2.weight", "geometry": NS},
        {"name": "head", "match": "output.weight", "geometry": {"kind": "adam"}, "weight_decay": 0.1},
        {"name": "norm", "match": "norm.weight", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "proximal_decay", "lam": 0.1}},
        {"name": "ln", "match": "**.*_norm.weight", "geometry": {"kind": "euclidean"},
         "constraint": {"kind": "linf_sphere", "radius": 1.0}},
    ],
}

# every post-stage (each second-moment axis, axis_norm and contra's power iteration) on experts and
# dense matrices, cautious decay, the heavy-ball and Lion directions
STAGED = {
    "geomopt": 1, "name": "staged_ep",
    "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True, "warmup_steps": 2,
                                           "warmup_alpha": 0.3}},
    "rules": [
        {"name": "w1", "match": "**.moe.experts.w1", "geometry": {**NS, "view": EXPERT_VIEW},
         "post": [{"kind": "second_moment", "axis": "row"}, {"kind": "dual_scale"},
                  {"kind": "rms_match", "target": "input"}, {"kind": "cautious"}],
         "weight_decay": 0.1, "decay": "cautious"},
        {"name": "w3", "match": "**.moe.experts.w3",
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                      "view": EXPERT_VIEW},
         "post": [{"kind": "second_moment", "axis": "column"}, {"kind": "axis_norm", "order": ["column", "row"]},
                  {"kind": "rms_match", "target": 0.2}],
         "direction": {"kind": "heavy_ball", "momentum": 0.9, "nesterov": True}},
        {"name": "w2", "match": "**.moe.experts.w2", "geometry": {**NS, "view": EXPERT_VIEW},
         "post": [{"kind": "contra", "coeff": 0.5},
                  {"kind": "second_moment", "axis": "element", "bias_correction": True},
                  {"kind": "rms_match", "target": "polar"}]},
        {"name": "wo", "match": "**.attention.wo.weight", "geometry": NS,
         "post": [{"kind": "contra", "coeff": 0.5}, {"kind": "axis_norm", "order": ["row", "column"]}]},
        {"name": "dense", "match": r"re:.*\.(attention\.wq|shared_experts\.w\d)\.weight", "geometry": NS,
         "post": [{"kind": "second_moment", "axis": "row"}, {"kind": "rms_match", "target": "polar"}]},
        {"name": "head", "match": "output.weight", "geometry": {"kind": "adam"}, "post": [{"kind": "cautious"}],
         "weight_decay": 0.1, "decay": "cautious"},
        {"name": "rest", "match": "**",
         "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
         "direction": {"kind": "lion"}, "lr": 1e-3},
    ],
}

# the experts' matrix work alone (everything else elementwise): what each rank computes and sends
# for the experts
EXPERTS_ONLY = {
    "geomopt": 1, "name": "experts_only",
    "rules": [{"name": "experts", "match": "**.moe.experts.*", "lr": 0.02, "geometry": {**NS, "view": EXPERT_VIEW}},
              {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}, "lr": 1e-3}],
}

SPECS = {**{name: str(path) for name, path in shipped_specs().items()}, "mixed": MIXED, "staged": STAGED}
SENT_SPECS = ("muon", "adamw-hybrid", "spectral-clip", "normuon", "experts_only")
LAYOUTS = {"fsdp_ep": 8, "fsdp_ep_rows": 2}  # layout: number of experts
ROWS_SPECS = ("muon", "staged", "mixed", "experts_only")  # mixed: its router gate (2, 16) cut over 4 ranks


class Experts(torch.nn.Module):
    """Routed experts as torchtitan's GroupedExperts: w1, w3 (E, hidden, dim), w2 (E, dim, hidden)."""

    def __init__(self, experts: int):
        super().__init__()
        self.num_experts = experts
        self.w1 = torch.nn.Parameter(torch.randn(experts, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, DIM, HIDDEN) / HIDDEN ** 0.5)
        self.w3 = torch.nn.Parameter(torch.randn(experts, HIDDEN, DIM) / DIM ** 0.5)

    def forward(self, x, weights):  # x (T, dim), weights (T, E): every expert sees every token, weighted
        h = torch.nn.functional.silu(torch.einsum("td,ehd->teh", x, self.w1)) * torch.einsum("td,ehd->teh", x,
                                                                                               self.w3)
        return torch.einsum("teh,edh,te->td", h, self.w2, weights)


class FeedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class MoE(torch.nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.router = torch.nn.Module()
        self.router.gate = torch.nn.Linear(DIM, experts, bias=False)
        self.experts = Experts(experts)
        self.shared_experts = FeedForward()

    def forward(self, x):
        weights = torch.softmax(self.router.gate(x), -1)
        return self.experts(x, weights) + self.shared_experts(x)


class Block(torch.nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.attention = torch.nn.Module()
        self.attention.wq = torch.nn.Linear(DIM, DIM, bias=False)
        self.attention.wo = torch.nn.Linear(DIM, DIM, bias=False)
        self.attention_norm = torch.nn.RMSNorm(DIM)
        self.ffn_norm = torch.nn.RMSNorm(DIM)
        self.moe = MoE(experts)

    def forward(self, x):  # (B, S, dim); a causal mixing of the sequence stands in for attention
        h = self.attention_norm(x)
        mix = torch.cumsum(torch.tanh(self.attention.wq(h)), 1) / torch.arange(1, x.shape[1] + 1)[:, None]
        x = x + self.attention.wo(mix)
        h = self.ffn_norm(x)
        return x + self.moe(h.reshape(-1, DIM)).reshape(x.shape)


class Model(torch.nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(experts) for _ in range(LAYERS)])
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def make_model(experts: int, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(experts)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(step))


def params_of(model) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


class World:
    """torchtitan's meshes for dp_shard = 4, ep = 2 (``ParallelDims.build_mesh``): dense ``dp_shard``
    (4), sparse ``efsdp`` × ``ep`` (2 × 2)."""

    def __init__(self):
        import torchtitan.distributed.parallel_dims as pd
        from torchtitan.distributed.parallel_dims import ParallelDims

        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend torchtitan gives size-1 mesh dims)

        pd.device_type = "cpu"  # torchtitan picks "cuda" on a machine without an accelerator
        self.dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=2, world_size=4)
        self.dims.build_mesh()
        self.dense = self.dims.get_mesh("dp_shard")
        self.ep = self.dims.get_mesh("ep")
        self.efsdp = self.dims.get_mesh("efsdp")

    def wrap(self, experts: int):
        """A fresh model (seed 0) laid out as torchtitan lays it out."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        model = make_model(experts)
        # efsdp × ep > E: FSDP2 shards the experts' dim 1 (torchtitan's rule, distributed/fsdp.py)
        placement = Shard(1) if self.efsdp.size() * self.ep.size() > experts else Shard(0)
        for layer in model.layers:
            mod = layer.moe.experts
            for name, p in list(mod.named_parameters()):  # ExpertParallel: Shard(0) over ep
                mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, self.ep, [Shard(0)])))
            fully_shard(mod, mesh=self.efsdp, shard_placement_fn=lambda p, pl=placement: pl)
            fully_shard(layer, mesh=self.dense)
        fully_shard(model, mesh=self.dense)
        return model


def one_process_grads(full: dict, experts: int, step: int) -> dict:
    model = make_model(experts)
    model.load_state_dict(full)
    model(batch(step)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def set_grads(world: World, model, grad_model, experts: int, step: int) -> None:
    """The whole model's one-process gradient, each parameter's shard laid out by torch (the full
    gradients loaded into an identically parallelized model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    grads = one_process_grads(params_of(model), experts, step)
    set_model_state_dict(grad_model, grads, options=StateDictOptions(full_state_dict=True))
    for (name, p), (gname, g) in zip(model.named_parameters(), grad_model.named_parameters()):
        assert name == gname and g.placements == p.placements and g.device_mesh == p.device_mesh
        p.grad = DTensor.from_local(g.to_local().detach().clone(), p.device_mesh, p.placements,
                                    shape=p.shape, stride=p.stride())


def train(world, model, grad_model, opt, experts, steps=range(STEPS), counter=None) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        set_grads(world, model, grad_model, experts, step)
        if counter is not None:
            with counter:
                opt.step()
        else:
            opt.step()


def run_layout(world: World, layout: str, result: dict) -> None:
    experts = LAYOUTS[layout]
    model, grad_model = world.wrap(experts), world.wrap(experts)
    start = {name: p.to_local().clone() for name, p in model.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    names = SPECS if layout == "fsdp_ep" else {k: v for k, v in SPECS.items() if k in ROWS_SPECS}
    names = {**names, "experts_only": EXPERTS_ONLY}
    for key in ("work", "sent"):
        result[key][layout] = {}
    result[layout], result["refused"][layout] = {}, {}
    for name, spec in names.items():
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.to_local().copy_(start[pname])
        try:
            opt = GeomOptimizer(model, spec)
        except ValueError as exc:  # a spec that refuses sharded tensors (dion): the refusal is the result
            result["refused"][layout][name] = str(exc)
            continue
        train(world, model, grad_model, opt, experts, range(1))
        counter = _counter() if name in SENT_SPECS else None
        train(world, model, grad_model, opt, experts, range(1, STEPS), counter)
        if counter is not None:
            result["sent"][layout][name] = counter.sent / param_bytes
        result[layout][name] = params_of(model)
        result["work"][layout][name] = opt.work.flops
    result["placements"][layout] = {n: str(p.placements) for n, p in model.named_parameters()}
    result["meshes"][layout] = {n: tuple(p.device_mesh.mesh_dim_names or ()) for n, p in model.named_parameters()}


def references(rank: int, size: int) -> dict:
    """One process (``distributed=False``) for this rank's share of (layout's experts, spec)."""
    jobs = [(experts, name, spec) for experts in sorted(set(LAYOUTS.values()))
            for name, spec in {**SPECS, "experts_only": EXPERTS_ONLY}.items()]
    out: dict = {}
    for i, (experts, name, spec) in enumerate(jobs):
        if i % size != rank:
            continue
        model = make_model(experts)
        try:
            opt = GeomOptimizer(model, spec, distributed=False)
        except ValueError:
            continue
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(batch(step)).backward()
            opt.step()
        out.setdefault(experts, {})[name] = dict(params=params_of(model), flops=opt.work.flops)
    return out


def round_trips(world: World) -> dict:
    """opt.state_dict() into a fresh optimizer, and a DCP save / load of model and optimizer,
    resume bit for bit under fsdp_ep."""

    experts = LAYOUTS["fsdp_ep"]
    out = {}
    for spec_name in ("muon", "staged"):
        spec = SPECS[spec_name]
        model, grads = world.wrap(experts), world.wrap(experts)
        opt = GeomOptimizer(model, spec)
        train(world, model, grads, opt, experts, range(2))
        saved_model, saved_opt, path = snapshot(model, opt)
        train(world, model, grads, opt, experts, range(2, 4))
        expected = params_of(model)

        fresh = world.wrap(experts)
        fresh.load_state_dict(saved_model)
        fresh_opt = GeomOptimizer(fresh, spec)
        fresh_opt.load_state_dict(saved_opt)
        train(world, fresh, grads, fresh_opt, experts, range(2, 4))
        got = params_of(fresh)

        via_dcp = world.wrap(experts)
        dcp_opt = GeomOptimizer(via_dcp, spec)
        load_dcp(via_dcp, dcp_opt, path)
        train(world, via_dcp, grads, dcp_opt, experts, range(2, 4))
        got_dcp = params_of(via_dcp)
        out[spec_name] = dict(state_dict=all(torch.equal(expected[k], got[k]) for k in expected),
                              dcp=all(torch.equal(expected[k], got_dcp[k]) for k in expected),
                              moved=any(not torch.equal(expected[k], saved_model[k].full_tensor())
                                        for k in expected))
    return out


def main(out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    world = World()
    result: dict = {"rank": rank, "work": {}, "sent": {}, "refused": {}, "placements": {}, "meshes": {},
                    "seconds": {}}
    t0 = time.perf_counter()
    refs = references(rank, size)  # "ref": the fsdp_ep model's (E = 8), "ref_rows": fsdp_ep_rows' (E = 2)
    result["ref"], result["ref_rows"] = refs.get(LAYOUTS["fsdp_ep"], {}), refs.get(LAYOUTS["fsdp_ep_rows"], {})
    result["ref_key"] = {"fsdp_ep_rows": "ref_rows"}  # the layouts whose reference is not "ref"
    for layout in LAYOUTS:
        run_layout(world, layout, result)
    result["round_trips"] = round_trips(world)
    result["seconds"]["total"] = time.perf_counter() - t0
    if rank != 0:  # the gathered parameters are the same on every rank: rank 0 keeps them
        for layout in LAYOUTS:
            result.pop(layout)
    finish(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
