"""Run by tests/test_layouts.py under ``torchrun --nproc_per_node 4`` and ``--nproc_per_node 8`` (gloo, CPU).

An HF Llama (random init from a config) trains for a few steps under every layout the world can
hold, for every shipped spec and two specs that use every operator locality and every
post-stage, and each run's parameters are gathered whole; each rank also computes the
single-process reference of its share of the specs. Every rank sees the same batch, so the
data-parallel gradients equal the one-process ones bit for bit and the differences are the
optimizer's (and, under tensor parallelism, the forward's split matmuls).

Layouts of 4 processes: ``ddp`` (two DDP pairs, ranks {0,1} and {2,3}), ``fsdp`` (FSDP2 on two
1-D meshes of 2), ``hsdp`` (a 2 × 2 mesh: Replicate × Shard), ``fsdp_tp`` (FSDP2 × TP on a 2 × 2
mesh: q, k, v, gate, up column-wise, o, down row-wise; embeddings, norms and the head FSDP2 only,
on the dp sub-mesh). Of 8 processes: ``hsdp_tp`` (HSDP × TP on a 2 × 2 × 2 (replicate, shard, tp)
mesh, the same TP plan; embeddings, norms and the head HSDP only, on the (replicate, shard)
sub-mesh).

Each layout's last step of each spec also counts the bytes the rank hands to collectives
(``sent``: benchmarks/_layouts.py's counter, ÷ the model's parameter bytes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from distributed_worker import _clone, finish, load_dcp, snapshot  # noqa: E402  (the 2-process worker's checkpoint helpers)
import geomopt  # noqa: E402
from geomopt import GeomOptimizer, shipped_specs  # noqa: E402

STEPS = 2
LAYOUTS = {4: ("ddp", "fsdp", "hsdp", "fsdp_tp"), 8: ("hsdp_tp",)}  # by world size
CFG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)

# every operator locality class: owner (SVD, polar, rank, spectral sphere, Stiefel, top-k), reduce
# (isotropic, rowwise, Frobenius / ℓ2 balls and spheres) and local (anisotropic, adam, ℓ∞, prox); ``m``
# names each rule's parameters in a model's own names (tests/pp_worker.py passes torchtitan's)
def mixed_spec(m: dict) -> dict:
    return {
        "geomopt": 1, "name": "mixed",
        "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.2}},
        "rules": [
            {"name": "embed", "match": m["embed"],
             "geometry": {"kind": "rowwise", "reference": {"kind": "log_barrier", "eps": 1e-8}},
             "constraint": {"kind": "frobenius_ball", "radius": 2.0}},
            {"name": "q", "match": m["q"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
                          "layout": "in_out"},
             "constraint": {"kind": "rank", "k": 4}},
            {"name": "k", "match": m["k"], "geometry": {"kind": "euclidean"}, "constraint": {"kind": "l0", "k": 100}},
            {"name": "v", "match": m["v"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}},
             "constraint": {"kind": "stiefel"}},
            {"name": "o", "match": m["o"],
             "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 2e-3},
                          "approx": {"kind": "polar_express", "steps": 6}, "layout": "in_out"},
             "constraint": {"kind": "spectral_sphere", "radius": 1.0}},
            {"name": "gate", "match": m["gate"],
             "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
             "constraint": {"kind": "frobenius_sphere", "radius": 3.0}},
            {"name": "up", "match": m["up"],
             "geometry": {"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}},
             "constraint": {"kind": "l2_ball", "radius": 1.5}},
            {"name": "down", "match": m["down"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
             "constraint": {"kind": "spectral_ball", "radius": 1.0}},
            {"name": "head", "match": m["head"], "geometry": {"kind": "adam"}, "weight_decay": 0.1},
            {"name": "norm", "match": m["norm"], "geometry": {"kind": "euclidean"},
             "constraint": {"kind": "proximal_decay", "lam": 0.1}},
            {"name": "ln", "match": m["ln"], "geometry": {"kind": "euclidean"},
             "constraint": {"kind": "linf_sphere", "radius": 1.0}},
        ],
    }


# every post-stage (each second-moment axis, axis_norm and contra's power iteration, over rows and columns cut
# by FSDP2 and by TP), cautious decay, the heavy-ball and Lion directions; ``m``: the q, mlp_in (gate and up),
# proj (o and down) and head rules' matches
def staged_spec(m: dict) -> dict:
    return {
        "geomopt": 1, "name": "staged",
        "defaults": {"lr": 0.01, "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True, "warmup_steps": 2,
                                               "warmup_alpha": 0.3}},
        "rules": [
            {"name": "q", "match": m["q"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"},
                          "layout": "in_out"},
             "post": [{"kind": "second_moment", "axis": "row"}, {"kind": "dual_scale"},
                      {"kind": "rms_match", "target": "input"}, {"kind": "cautious"}],
             "weight_decay": 0.1, "decay": "cautious"},
            {"name": "mlp_in", "match": m["mlp_in"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}},
             "post": [{"kind": "second_moment", "axis": "column"}, {"kind": "axis_norm", "order": ["column", "row"]},
                      {"kind": "rms_match", "target": 0.2}],
             "direction": {"kind": "heavy_ball", "momentum": 0.9, "nesterov": True}},
            {"name": "proj", "match": m["proj"],
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
             "post": [{"kind": "contra", "coeff": 0.5},
                      {"kind": "second_moment", "axis": "element", "bias_correction": True},
                      {"kind": "rms_match", "target": "polar"}]},
            {"name": "head", "match": m["head"], "geometry": {"kind": "adam"}, "post": [{"kind": "cautious"}],
             "weight_decay": 0.1, "decay": "cautious"},
            {"name": "rest", "match": "**",
             "geometry": {"kind": "anisotropic", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}},
             "direction": {"kind": "lion"}, "lr": 1e-3},
        ],
    }


MIXED = mixed_spec(dict(embed="model.embed_tokens.weight", q="**.q_proj.weight", k="**.k_proj.weight",
                        v="**.v_proj.weight", o="**.o_proj.weight", gate="**.gate_proj.weight",
                        up="**.up_proj.weight", down="**.down_proj.weight", head="lm_head.weight",
                        norm="model.norm.weight", ln="**.*_layernorm.weight"))
STAGED = staged_spec(dict(q="**.q_proj.weight", mlp_in=r"re:.*\.(gate|up)_proj\.weight",
                          proj=r"re:.*\.(o|down)_proj\.weight", head="lm_head.weight"))

#: Shampoo with its factors in bfloat16: on shards each matrix's owner encodes them as one process does
KRON_FACTORS = {"geomopt": 1, "name": "shampoo-bf16-factors", "rules": [
    {"name": "hidden", "match": {"role": ["hidden"]}, "state": {"factors": "bfloat16"},
     "geometry": {"kind": "kronecker", "method": "shampoo", "every": 2, "graft": "adam"}},
    {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}

SPECS = {**{name: str(path) for name, path in shipped_specs().items()}, "mixed": MIXED, "staged": STAGED,
         "shampoo-bf16-factors": KRON_FACTORS}
#: specs whose update turns the last bits of a gradient into steps of the update's size: SOAP's first
#: Adam step in eigenbases that a rank-deficient factor (k, v: 16 × 32 matrices, R of rank ≤ 16 at the
#: first step) leaves undetermined, where Adam scales an entry of rounding noise to ±1 (one process:
#: gradients perturbed by 1e-7 relative move the weights by 0.085 relative). Tensor parallelism's split
#: matmuls change the gradients' last bits, so under it these specs step on the one-process gradients:
#: what is compared is the optimizer alone. So does Shampoo with bf16 factors: a factor one float32
#: rounding apart may round stochastically to the other bf16 neighbour (2⁻⁸ apart), which its root carries
#: into every later step (4e-3 relative after the run under FSDP2 × TP on its own gradients)
REPLAYED = ("soap", "soap-muon", "shampoo-bf16-factors")
TP_LAYOUTS = ("fsdp_tp", "hsdp_tp")


class Experts(torch.nn.Module):
    """An MoE layer's experts as one (E, out, in) weight, each expert a matrix (the spec's view), E = 5
    so that FSDP2 cuts them unevenly (3 + 2 over 2 ranks; 2 + 2 + 1 + 0 would be over 4)."""

    def __init__(self, experts: int = 5, d: int = 8, h: int = 12):
        super().__init__()
        torch.manual_seed(3)
        self.inp = torch.nn.Linear(d, d)
        self.experts = torch.nn.Parameter(torch.randn(experts, h, d) / d ** 0.5)

    def forward(self, x):
        return torch.einsum("bd,ehd->beh", self.inp(x), self.experts).tanh().square().mean()


EXPERT_SPEC = {
    "geomopt": 1, "name": "experts",
    "rules": [
        {"name": "experts", "match": "experts", "lr": 0.02,
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"},
                      "view": {"kind": "matrix", "batch": 1}},
         "constraint": {"kind": "spectral_ball", "radius": 1.0}},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "lr": 1e-3},
    ],
}


def experts(world: "World") -> dict:
    """Experts cut whole across ranks (FSDP2 ×2 and ×4, HSDP 2×2: Shard(0) of the expert dim): each rank
    orthogonalizes its own experts, so the work splits without a gather, and the update is the
    one-process update."""
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))

    def run(model, **kw):
        opt = GeomOptimizer(model, EXPERT_SPEC, **kw)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(x).backward()
            opt.step()
        return params_of(model), opt.work.flops

    ref, ref_flops = run(Experts(), distributed=False)
    out = {"ref_flops": ref_flops}
    for layout, mesh in (("fsdp", world.hsdp["shard"]), ("hsdp", world.hsdp), ("fsdp4", world.flat)):
        model = Experts()
        fully_shard(model, mesh=mesh)
        got, flops = run(model)
        out[layout] = dict(flops=flops, max_rel=max(float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref))
    return out


def make_model(seed: int = 0, cfg: dict = CFG):
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.train()
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(step))


def train(model, opt, steps=range(STEPS), forward=None, counter=None, grads=None) -> None:
    """``counter`` (a dispatch mode) watches the last step's ``opt.step()`` only; ``grads`` (a list of
    {name: whole gradient} per step): each rank's gradient blocks are replaced by those gradients'."""
    for step in steps:
        opt.zero_grad(set_to_none=True)
        ids = batch(step)
        (forward or model)(input_ids=ids, labels=ids).loss.backward()
        if grads is not None:
            replay(model, opt, grads[step])
        if counter is not None and step == steps[-1]:
            with counter:
                opt.step()
        else:
            opt.step()


def one_process_grads(spec, steps=range(STEPS)) -> list:
    """The gradients of a one-process run of ``spec``, per step ({name: tensor})."""
    model = make_model()
    opt = GeomOptimizer(model, spec, distributed=False)
    out = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        out.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
    return out


def replay(model, opt, grads: dict) -> None:
    """Each sharded parameter's gradient block set to its block of ``grads[name]`` (where the
    optimizer's layout says it lies)."""
    executor = opt.engine.executor
    with torch.no_grad():
        for name, p in model.named_parameters():
            block = executor.layouts[id(p)].slices(executor.rank)
            p.grad.to_local().copy_(grads[name][block])


def params_of(model) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


class World:
    """The world's meshes and groups (built once: every rank creates them in order): of 4 processes
    for the 1-D and 2-D layouts, of 8 for the 3-D one."""

    def __init__(self):
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.layouts = LAYOUTS[self.size]
        if self.size == 8:
            self.mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
            return
        self.pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.pair = self.pairs[self.rank // 2]
        self.hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        self.tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        self.flat = init_device_mesh("cpu", (4,))

    def wrap(self, layout: str, model):
        """(the model as laid out, the forward to call, GeomOptimizer keyword arguments)."""
        from torch.distributed.fsdp import fully_shard

        if layout == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return model, DDP(model, process_group=self.pair), dict(process_group=self.pair)
        if layout in ("fsdp_tp", "hsdp_tp"):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {}
            for i in range(len(model.model.layers)):
                for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                             "mlp.up_proj"):
                    plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
                for name in ("self_attn.o_proj", "mlp.down_proj"):
                    plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
            tp_mesh = self.tp if layout == "fsdp_tp" else self.mesh3
            parallelize_module(model, tp_mesh["tp"], plan)
            mesh = self.tp["dp"] if layout == "fsdp_tp" else self.mesh3["rep", "shard"]
        else:
            mesh = self.hsdp["shard"] if layout == "fsdp" else self.hsdp
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model, {}


def run_layouts(world: World, result: dict) -> None:
    for layout in world.layouts:
        model, forward, kwargs = world.wrap(layout, make_model())
        start = {name: _local(p).clone() for name, p in model.named_parameters()}
        result[layout], result["work"][layout], result["seconds"][layout] = {}, {}, {}
        for name, spec in SPECS.items():
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    _local(p).copy_(start[pname])
            try:
                opt = GeomOptimizer(model, spec, **kwargs)
            except (ValueError, NotImplementedError) as exc:  # a spec that refuses sharded tensors (dion,
                if layout == "ddp":  # QK-clip): the refusal is the result
                    raise
                result.setdefault("refused", {}).setdefault(layout, {})[name] = str(exc)
                continue
            grads = one_process_grads(spec) if name in REPLAYED and layout in TP_LAYOUTS else None
            t0 = time.perf_counter()
            counter = _counter()
            with clip_monitor(model, opt):
                train(model, opt, forward=forward, counter=counter, grads=grads)
            result["seconds"][layout][name] = time.perf_counter() - t0
            result.setdefault("sent", {}).setdefault(layout, {})[name] = counter.sent / param_bytes(model)
            result[layout][name] = params_of(model)
            result["work"][layout][name] = opt.work.flops
            if name == "muon":
                result.setdefault("executor", {})[layout] = type(opt.engine.executor).__name__
        result.setdefault("placements", {})[layout] = {n: str(getattr(p, "placements", "")) for n, p in
                                                       model.named_parameters()}


@contextlib.contextmanager
def clip_monitor(model, opt):
    """An attention monitor on ``model`` while the block runs, where the spec has QK-clip (which reads
    the logits it keeps; the maxima are reduced over the data-parallel ranks, which see one batch)."""
    monitor = geomopt.monitor_attention(model) if any(pp.qk_clip is not None for pp in opt.plan) else None
    try:
        yield
    finally:
        if monitor is not None:
            monitor.remove()


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's: the whole tensor's


def _counter():
    """benchmarks/_layouts.py's dispatch mode counting the bytes this rank sends to collectives."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from _layouts import _counter as make

    return make()


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p.data


def references(rank: int, world: int) -> dict:
    """One process (``distributed=False``) for this rank's share of the specs."""
    out = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        if i % world == rank:
            model = make_model()
            opt = GeomOptimizer(model, spec, distributed=False)
            with clip_monitor(model, opt):
                train(model, opt)
            out[name] = dict(params=params_of(model), flops=opt.work.flops)
    return out


def round_trips(world: World, layouts=("hsdp", "fsdp_tp"), specs=("staged", "mixed"), cfg: dict = CFG) -> dict:
    """HSDP and FSDP2 × TP: opt.state_dict() into a fresh optimizer, and a DCP save / load of
    model and optimizer, resume bit for bit; the state is sharded like the parameters. ``specs``:
    names of :data:`SPECS`, or (name, spec) pairs."""
    from torch.distributed.tensor import DTensor

    out = {}
    for layout in layouts:
        for entry in specs:
            spec_name, spec = (entry, SPECS[entry]) if isinstance(entry, str) else entry
            model, forward, kw = world.wrap(layout, make_model(cfg=cfg))
            opt = GeomOptimizer(model, spec, **kw)
            train(model, opt, range(2), forward)
            like = all(isinstance(v, DTensor) and v.device_mesh == p.device_mesh
                       for p in model.parameters() for k, v in opt.state[p].items()
                       if isinstance(v, torch.Tensor) and v.ndim > 0)
            plain_like = all(v.placements == p.placements and v.shape == p.shape
                             for p in model.parameters() for k, v in opt.state[p].items()
                             if k in ("d", "exp_avg", "exp_avg_sq"))
            saved_model, saved_opt, path = snapshot(model, opt)
            train(model, opt, range(2, 4), forward)
            expected = params_of(model)

            fresh, fwd, kw = world.wrap(layout, make_model(seed=7, cfg=cfg))
            fresh.load_state_dict(saved_model)
            fresh_opt = GeomOptimizer(fresh, spec, **kw)
            fresh_opt.load_state_dict(saved_opt)
            train(fresh, fresh_opt, range(2, 4), fwd)
            got = params_of(fresh)

            via_dcp, fwd, kw = world.wrap(layout, make_model(seed=7, cfg=cfg))
            dcp_opt = GeomOptimizer(via_dcp, spec, **kw)
            load_dcp(via_dcp, dcp_opt, path)
            train(via_dcp, dcp_opt, range(2, 4), fwd)
            got_dcp = params_of(via_dcp)
            out[(layout, spec_name)] = dict(
                state_dict=all(torch.equal(expected[k], got[k]) for k in expected),
                dcp=all(torch.equal(expected[k], got_dcp[k]) for k in expected),
                dtensor_state=like, placed_like_params=plain_like)
    return out


#: SOAP with its moments kept in bfloat16 (one process encodes them; a sharded run refuses it)
KRON_BF16 = {"geomopt": 1, "name": "soap-bf16", "defaults": {"state": "bfloat16"}, "rules": [
    {"name": "hidden", "match": {"role": ["hidden"]}, "geometry": {"kind": "kronecker", "method": "soap"}},
    {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}


def owned_state(world: World, layout: str = "fsdp_tp", spec: str = "soap") -> dict:
    """Which tensors' kronecker state this rank keeps (a sharded matrix's: on its owner alone), and the
    bytes of it, after a run of ``spec``."""
    from geomopt.optim.units.state_keys import geometry_state

    model, forward, kw = world.wrap(layout, make_model())
    opt = GeomOptimizer(model, SPECS[spec], **kw)
    train(model, opt, forward=forward)
    out: dict = {"held": {}, "bytes": 0}
    plans = {pp.name: pp for pp in opt.plan}
    for name, p in model.named_parameters():
        pp = plans[name]
        keys = geometry_state(pp.geometry)
        if keys and pp.geometry.kind == "kronecker":
            held = [k for k in keys if k in opt.state[p]]
            out["held"][name] = held == list(keys)
            out["bytes"] += sum(opt.state[p][k].numel() * opt.state[p][k].element_size() for k in held)
            assert held in ([], list(keys)), (name, held)  # all of the kind, or none
    return out


def bad_input(world: World) -> dict:
    """Refusals: a Partial placement, a _StridedShard nesting FSDP2 does not make (its split factor
    is not the size of the mesh dim that shards the same dim after it), a state_dict from another
    mesh shape."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {}
    w = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), world.hsdp, (Replicate(), Partial()),
                                              run_check=False))
    out["partial"] = _error(lambda: GeomOptimizer([("blocks.0.w", w)], "muon"))
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    w3 = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), mesh3, (Replicate(), _StridedShard(0, split_factor=3),
                                                                          Shard(0)), run_check=False))
    out["strided"] = _error(lambda: GeomOptimizer([("blocks.0.w3", w3)], "muon"))
    model, forward, kw = world.wrap("hsdp", make_model())
    opt = GeomOptimizer(model, "muon", **kw)
    train(model, opt, range(1), forward)
    sd = opt.state_dict()
    other, forward, kw = world.wrap("fsdp_tp", make_model())
    out["mesh_change"] = _error(lambda: GeomOptimizer(other, "muon", **kw).load_state_dict(sd))
    # the kronecker geometry's state, kept float32 by each matrix's owner: another precision is refused;
    # an owner's state loaded on another rank (rank 0 given rank 1's state dict) is refused
    model, forward, kw = world.wrap("fsdp", make_model())
    out["kron_bf16"] = _error(lambda: GeomOptimizer(model, KRON_BF16, **kw))
    opt = GeomOptimizer(model, "soap", **kw)
    train(model, opt, forward=forward)
    sd = _clone(opt.state_dict())
    kept = [i for i, e in sd["state"].items() if "soap_step" in e]  # the matrices this rank owns
    kron = [i for g in sd["param_groups"] if g["rule"] in ("kv", "hidden") for i in g["params"]]
    other = next(i for i in kron if i not in kept)  # another rank's: its entry as that rank would save it
    sd["state"][other] = dict(sd["state"][kept[0]])
    fresh, _, kw = world.wrap("fsdp", make_model())
    out["kron_other_rank"] = _error(lambda: GeomOptimizer(fresh, "soap", **kw).load_state_dict(sd))
    return out


def bad_input3(world: World) -> dict:
    """Refusals on the 3-D mesh: a Partial placement on its tp dim, and an optimizer state from
    HSDP × TP loaded where the same model is laid out with TP over the replicate dim instead."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), world.mesh3, (Replicate(), Shard(0), Partial()),
                                              run_check=False))
    out = {"partial": _error(lambda: GeomOptimizer([("blocks.0.w", w)], "muon"))}
    model, forward, kw = world.wrap("hsdp_tp", make_model())
    opt = GeomOptimizer(model, "muon", **kw)
    train(model, opt, range(1), forward)
    sd = opt.state_dict()
    other = make_model()
    from torch.distributed.fsdp import fully_shard

    fully_shard(other, mesh=world.mesh3["rep", "shard"])
    out["mesh_change"] = _error(lambda: GeomOptimizer(other, "muon").load_state_dict(sd))
    return out


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def diagnostics(world: World, layouts=("hsdp", "fsdp_tp")) -> dict:
    """``track_update`` norms under HSDP and FSDP2 × TP against one process: replicas count their
    block once."""
    spec = SPECS["mixed"]
    ref = make_model()
    opt = GeomOptimizer(ref, spec, distributed=False, track_update=True)
    train(ref, opt)
    out = {"ref": {rule: d["update_norm"] for rule, d in opt.diagnostics().items()}}
    for layout in layouts:
        model, forward, kw = world.wrap(layout, make_model())
        opt = GeomOptimizer(model, spec, track_update=True, **kw)
        train(model, opt, forward=forward)
        out[layout] = {rule: d["update_norm"] for rule, d in opt.diagnostics().items()}
    return out


def nonfinite(world: World, layout: str = "fsdp_tp") -> dict:
    """A NaN in one rank's TP block only (the last rank's): every rank skips the step, nothing is written."""
    model, forward, kw = world.wrap(layout, make_model())
    opt = GeomOptimizer(model, "muon", **kw)
    train(model, opt, range(1), forward)
    before = params_of(model)
    opt.zero_grad(set_to_none=True)
    ids = batch(5)
    forward(input_ids=ids, labels=ids).loss.backward()
    if dist.get_rank() == world.size - 1:
        model.model.layers[0].mlp.down_proj.weight.grad.to_local()[0, 0] = float("nan")
    opt.step()
    after = params_of(model)
    return dict(unchanged=all(torch.equal(before[k], after[k]) for k in before),
                skipped={rule: d["skipped"] for rule, d in opt.diagnostics().items()})


def merged(ranks: list, key: str) -> dict:
    """The ranks' dicts under ``key`` as one (each rank saved its share)."""
    out: dict = {}
    for r in ranks:
        out.update(r[key])
    return out


def launch(nproc: int, out: Path, script: str = __file__) -> list:
    """Run ``script`` (this worker) under ``torchrun --nproc_per_node nproc`` into ``out``; each rank's
    results."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script,
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    world = World()
    result: dict = {"work": {}, "seconds": {}, "rank": rank}
    t0 = time.perf_counter()
    result["ref"] = references(rank, size)
    result["seconds"]["ref"] = time.perf_counter() - t0
    run_layouts(world, result)
    if size == 8:
        result["round_trips"] = round_trips(world, ("hsdp_tp",))
        result["diagnostics"] = diagnostics(world, ("hsdp_tp",))
        result["nonfinite"] = nonfinite(world, "hsdp_tp")
        result["errors"] = bad_input3(world)
    else:
        result["round_trips"] = round_trips(world)
        # the kronecker specs' state, kept on each matrix's owner: a state dict and DCP resume bit for bit
        result["round_trips"].update(round_trips(world, ("fsdp_tp",), ("soap", "shampoo", "psgd-kron")))
        result["owned"] = owned_state(world)
        result["experts"] = experts(world)
        result["diagnostics"] = diagnostics(world)
        result["errors"] = bad_input(world)
        result["nonfinite"] = nonfinite(world)
    result["seconds"]["total"] = time.perf_counter() - t0
    if rank != 0:  # the gathered parameters are the same on every rank: rank 0 keeps them
        for layout in world.layouts:
            result.pop(layout)
    finish(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
