"""Run by tests/test_pipeline_parallel.py under ``torchrun --nproc_per_node 4`` (gloo, CPU).

Layout ``pp_fsdp``: pipeline parallelism over 2 stages × FSDP2 over the 2 ranks of each stage (a
(pp, dp_shard) mesh: stage 0 on ranks {0, 1}, stage 1 on {2, 3}), laid out as torchtitan's
trainer does it: torchtitan's llama3 debug model (shrunk: 2 layers, dim 64, vocab 256; its
canonical parameter names) is split into one model part per stage by torchtitan's own pipeline
code (``_generate_llm_fqn_per_model_part``, ``_pipeline_module_split``), each part
``fully_shard``-ed on its stage's dp mesh, its gradients computed by a real pipeline schedule
(torch.distributed.pipelining's ``ScheduleGPipe``, 2 microbatches, activations sent between the
stages over gloo), and its optimizer built through torchtitan's container
(``geomopt_optimizer(spec).build(model_parts=[the part this rank holds])``: one GeomOptimizer per
part). The attention is torchtitan's ScaledDotProductAttention (its FlexAttention has no CPU
backward: tests/test_torchtitan.py).

Every rank of a stage sees the same batch, and each microbatch's loss is its mean cross-entropy
over the number of microbatches, so the accumulated gradient is the whole batch's mean
cross-entropy gradient up to float rounding (the reference is one process on the whole model and
the whole batch). Each rank also computes the one-process reference of a quarter of the specs.

Saved per rank (``rank{r}.pt``): ``ref`` {spec: {"params"}}, ``pp_fsdp`` {spec: {name: full
tensor}} (dp rank 0 of each stage, its part's tensors), ``sent`` {"pp_fsdp": {spec: bytes this rank
sends in one optimizer step / the part's parameter bytes}}, ``refused``, ``placements``, ``groups``
(the ranks of every collective a step issued), ``gradients``, ``round_trips``, ``whole_model``
and ``stage``.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from geomopt import GeomOptimizer, shipped_specs  # noqa: E402
from geomopt.integrations.torchtitan import geomopt_optimizer  # noqa: E402
from layout_worker import mixed_spec, staged_spec  # noqa: E402

STEPS = 2
STAGES, DP = 2, 2
MICROBATCHES = 2
DIM, HEADS, HIDDEN, LAYERS, VOCAB = 64, 4, 128, 2, 256
COUNTED = ("muon", "adamw-hybrid", "spectral-clip", "normuon")  # specs whose bytes sent are measured
ROUND_TRIPS = ("muon", "staged")

# tests/layout_worker.py's MIXED and STAGED under the debug model's names (a fused wqkv; w1, w3, w2 are
# gate, up, down)
MIXED = mixed_spec(dict(embed="tok_embeddings.weight", q="layers.0.attention.qkv_linear.wqkv.weight",
                        k="layers.1.attention.qkv_linear.wqkv.weight", v="layers.0.attention.wo.weight",
                        o="layers.1.attention.wo.weight", gate="**.feed_forward.w1.weight",
                        up="**.feed_forward.w3.weight", down="**.feed_forward.w2.weight", head="lm_head.weight",
                        norm="norm.weight", ln="**.*_norm.weight"))
STAGED = staged_spec(dict(q="**.qkv_linear.wqkv.weight", mlp_in=r"re:.*\.(w1|w3)\.weight",
                          proj=r"re:.*\.(wo|w2)\.weight", head="lm_head.weight"))

SPECS = {**{name: str(path) for name, path in shipped_specs().items()}, "mixed": MIXED, "staged": STAGED}


def model_config():
    """torchtitan's llama3 debugmodel config (its builders and inits), 2 layers of dim 64 over a
    256-token vocabulary, with ScaledDotProductAttention (causal) for its FlexAttention."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)

    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=HIDDEN,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000,
                                                            scaling="llama"), attn_backend="flex"))
    for _fqn, _cfg, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def make_model(seed: int = 0) -> torch.nn.Module:
    """The whole model as torchtitan's trainer builds it (meta device, then init_weights on CPU)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step))


def whole_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the batch's tokens."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def microbatch_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A microbatch's share of the whole batch's mean (equal microbatches): the schedule sums the
    microbatches' gradients (scale_grads=False, as torchtitan builds it)."""
    return whole_loss(logits, tokens) / MICROBATCHES


def spec_ref(name: str, spec, folder: Path) -> str:
    """What geomopt_optimizer takes: a shipped spec's path, or a dict spec written to a .yaml (JSON is YAML)."""
    if isinstance(spec, str):
        return spec
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


def full(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p.data


class Stage:
    """This rank's model part (torchtitan's split, FSDP2 on the stage's dp mesh) and its pipeline schedule."""

    def __init__(self, mesh, seed: int = 0):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import ScheduleGPipe
        from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _pipeline_module_split

        self.fqns = _generate_llm_fqn_per_model_part(STAGES, LAYERS, 1, 1)
        stages, parts = _pipeline_module_split(make_model(seed), mesh["pp"], "GPipe", torch.device("cpu"),
                                               self.fqns)
        (self.stage,), (self.part,) = stages, parts
        for block in self.part.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(self.part, mesh=mesh["dp_shard"])
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=MICROBATCHES, loss_fn=microbatch_loss,
                                      scale_grads=False)

    def backward(self, tokens: torch.Tensor) -> None:
        """One pipeline step (forward and backward of every microbatch): the part's gradients."""
        if self.stage.is_first:
            self.schedule.step(tokens)
        else:
            self.schedule.step(target=tokens, losses=[])

    def train(self, container, steps, recorder=None) -> None:
        """Steps of the pipeline and the container; ``recorder`` watches every optimizer step and
        keeps the bytes sent in the last."""
        for step in steps:
            container.zero_grad(set_to_none=True)
            self.backward(batch(step))
            if recorder is None:
                container.step()
                continue
            before = recorder.mode.sent
            with recorder:
                container.step()
            recorder.last = recorder.mode.sent - before


class Recorder:
    """Counts the bytes this rank sends (benchmarks/_layouts.py's counter) and the ranks of every
    collective's group, as the dispatcher sees them."""

    def __init__(self):
        from _layouts import _counter

        self.groups: set = set()
        outer = self

        class Mode(type(_counter())):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional") and func.__name__.split(".")[0] != "wait_tensor":
                    outer.groups.add(_group_ranks(args))  # (a wait names no group)
                return super().__torch_dispatch__(func, types, args, kwargs)

        self.mode = Mode()
        self.last = 0.0

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _group_ranks(args) -> tuple:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            except Exception:  # a string that names no group (a reduce op)
                continue
        if isinstance(a, torch.ScriptObject):
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            except Exception:  # another boxed object (a work handle, a reduce op)
                continue
    return ("unknown",)


def gradient_deviation(me: Stage) -> dict:
    """The pipeline's gradients (microbatches summed) against one process's on the whole batch:
    max over tensors of ‖G − G₁‖_F / ‖G₁‖_F, on the first batch."""
    me.part.zero_grad(set_to_none=True)
    me.backward(batch(0))
    got = {n: p.grad.full_tensor() for n, p in me.part.named_parameters()}
    me.part.zero_grad(set_to_none=True)
    model, tokens = make_model(), batch(0)
    whole_loss(model(tokens), tokens).backward()
    ref = {n: p.grad for n, p in model.named_parameters() if n in got}
    return dict(names=sorted(got), max_rel=max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in got))


def run_pp(mesh, folder: Path, result: dict) -> None:
    me = Stage(mesh)
    result["gradients"] = gradient_deviation(me)
    start = {n: _local(p).clone() for n, p in me.part.named_parameters()}
    part_bytes = sum(p.numel() * p.element_size() for p in me.part.parameters())  # the part's full tensors
    stage_ranks = tuple(sorted(dist.get_process_group_ranks(mesh["dp_shard"].get_group())))
    result["stage"] = dict(index=me.stage.stage_index, ranks=stage_ranks, fqns=me.fqns)
    result.update(pp_fsdp={}, sent={"pp_fsdp": {}}, refused={"pp_fsdp": {}}, groups={}, executor_group={})
    for name, spec in SPECS.items():
        with torch.no_grad():
            for n, p in me.part.named_parameters():
                _local(p).copy_(start[n])
        try:
            container = geomopt_optimizer(spec_ref(name, spec, folder)).build(model_parts=[me.part])
        except ValueError as exc:  # a spec that refuses sharded tensors (dion): the refusal is the result
            result["refused"]["pp_fsdp"][name] = str(exc)
            continue
        (opt,) = container.optimizers
        group = opt.engine.executor.group
        result["executor_group"][name] = tuple(dist.get_process_group_ranks(group if group is not None
                                                                             else dist.group.WORLD))
        rec = Recorder()
        me.train(container, list(range(STEPS)), rec)
        result["groups"][name] = sorted(rec.groups, key=str)
        if name in COUNTED:
            result["sent"]["pp_fsdp"][name] = rec.last / part_bytes
        got = full(me.part)
        if mesh["dp_shard"].get_local_rank() == 0:
            result["pp_fsdp"][name] = got
    result["placements"] = {"pp_fsdp": {n: str(p.placements) for n, p in me.part.named_parameters()}}


def references(rank: int, world: int, microbatched: bool = False) -> dict:
    """One process, the whole model, the whole batch (``distributed=False``) for this rank's share of
    the specs; ``microbatched``: its gradient accumulated over the pipeline's microbatches in the
    pipeline's order (the pipeline's gradients as one process computes them)."""
    out = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        if i % world != rank:
            continue
        model = make_model()
        try:
            opt = GeomOptimizer(model, spec, distributed=False)
        except ValueError as exc:
            out[name] = dict(refused=str(exc))
            continue
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            tokens = batch(step)
            if microbatched:
                for mb in tokens.chunk(MICROBATCHES):
                    microbatch_loss(model(mb), mb).backward()
            else:
                whole_loss(model(tokens), tokens).backward()
            opt.step()
        out[name] = dict(params=full(model))
    return out


def round_trips(mesh, folder: Path) -> dict:
    """The container's flat state dict into a fresh container on fresh parts, and a DCP save / load
    of each part and its container (Stateful, as torchtitan's checkpointer saves it), resume bit for bit."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name in ROUND_TRIPS:
        ref = spec_ref(name, SPECS[name], folder)
        me = Stage(mesh)
        container = geomopt_optimizer(ref).build(model_parts=[me.part])
        me.train(container, [0])
        saved_model = {k: v.detach().clone() for k, v in me.part.state_dict().items()}
        before = {n: _local(p).clone() for n, p in me.part.named_parameters()}
        saved_opt = {k: v.clone() if torch.is_tensor(v) else v for k, v in container.state_dict().items()}
        path = [tempfile.mkdtemp(prefix="geomopt-pp-dcp-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path)
        dcp.save({"model": me.part.state_dict(), "optim": container}, checkpoint_id=path[0])
        me.train(container, [1])
        expected = {n: _local(p).clone() for n, p in me.part.named_parameters()}

        fresh = Stage(mesh, seed=7)
        fresh.part.load_state_dict(saved_model)
        fresh_container = geomopt_optimizer(ref).build(model_parts=[fresh.part])
        fresh_container.load_state_dict(saved_opt)
        fresh.train(fresh_container, [1])
        flat = all(torch.equal(_local(p), expected[n]) for n, p in fresh.part.named_parameters())

        loaded = Stage(mesh, seed=7)
        loaded_container = geomopt_optimizer(ref).build(model_parts=[loaded.part])
        state = {"model": loaded.part.state_dict(), "optim": loaded_container}
        dcp.load(state, checkpoint_id=path[0])
        loaded.part.load_state_dict(state["model"])
        loaded.train(loaded_container, [1])
        dcp_ok = all(torch.equal(_local(p), expected[n]) for n, p in loaded.part.named_parameters())
        moved = any(not torch.equal(expected[n], before[n]) for n in before)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        out[name] = dict(state_dict=flat, dcp=dcp_ok, moved=moved,
                         keys=sorted(k for k in saved_opt if k.startswith("state."))[:3])
    return out


def whole_model(mesh, folder: Path) -> dict:
    """What depends on the whole model. QK-clip (no shipped spec has it) reduces logit maxima over
    attention modules: on sharded parameters it is refused at construction. The non-finite test
    is the step's, per optimizer, AND-ed over its executor's group: under pipeline parallelism a
    part's optimizer skips its step for a non-finite gradient of its own part, on every rank of its
    stage, while the other stage's steps (one process skips the whole model's step)."""
    spec = {"geomopt": 1, "name": "qk", "rules": [
        {"name": "qkv", "match": "**.wqkv.weight", "geometry": {"kind": "spectral", "reference": {"kind": "indicator"},
         "approx": {"kind": "newton_schulz"}}, "qk_clip": {"kind": "max_logit", "tau": 10.0, "alpha": 0.5}},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "lr": 1e-3}]}
    me = Stage(mesh)
    out: dict = {}
    try:
        geomopt_optimizer(spec_ref("qk", spec, folder)).build(model_parts=[me.part])
    except (NotImplementedError, ValueError) as exc:
        out["qk_clip"] = f"{type(exc).__name__}: {exc}"
    container = geomopt_optimizer("muon").build(model_parts=[me.part])
    me.train(container, [0])
    before = {n: _local(p).clone() for n, p in me.part.named_parameters()}
    container.zero_grad(set_to_none=True)
    me.backward(batch(1))
    if dist.get_rank() == 2:  # one rank of stage 1: a NaN in its block of one gradient
        _local(me.part.layers["1"].feed_forward.w2.weight.grad).view(-1)[0] = float("nan")
    container.step()
    out["nonfinite"] = dict(
        unchanged=all(torch.equal(_local(p), before[n]) for n, p in me.part.named_parameters()),
        skipped={rule: d["skipped"] for rule, d in container.optimizers[0].diagnostics().items()})
    return out


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    out = Path(sys.argv[1])
    # a collective the stages issue unlike each other would hang: fail after a minute instead
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (STAGES, DP), mesh_dim_names=("pp", "dp_shard"))
    folder = Path(tempfile.mkdtemp(prefix=f"geomopt-pp-specs-{rank}-"))
    result: dict = {"rank": rank}
    run_pp(mesh, folder, result)
    result["round_trips"] = round_trips(mesh, folder)
    result["whole_model"] = whole_model(mesh, folder)
    result["ref"] = references(rank, world)
    result["ref_microbatched"] = references(rank, world, microbatched=True)
    torch.save(result, out / f"rank{rank}.pt")
    shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
