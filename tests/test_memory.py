"""What the optimizer holds between steps: the algorithm's own state, counted independently from
the plan (a momentum per tensor that has a direction, two moments per Adam tensor, the previous
iterate for STORM), and nothing else: the step's scratch (one workspace bounded by the largest
bucket) is released at the end of each step, as torch's optimizers free their temporaries. And the
flat path's chunking (the workspace's bound during a step) changes no bit of the step."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.optim.units.state_keys import COUNTS

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "specs").rglob("*.yaml"))


def _held_storages():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.held_storages


held_storages = _held_storages()


def _llama():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)

    def loss(step):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        return model(ids, labels=ids).loss

    return model, loss


def _gpt():
    from optim_helpers import gpt_batch, loss_of, tiny_gpt

    model = tiny_gpt(0)
    return model, lambda step: loss_of(model, gpt_batch(step))


def expected_state_bytes(opt, model) -> int:
    """The bytes of the state each tensor's algorithm keeps (float32 at least), from the plan."""
    named = dict(model.named_parameters())
    total = 0
    for pp in opt.plan:
        t = named[pp.name]
        n, size = t.numel(), max(t.element_size(), 4)
        if pp.direction["kind"] != "none":
            total += n * size  # d
        if pp.direction["kind"] == "storm":
            total += n * t.element_size()  # the previous iterate
        if pp.direction["kind"] == "dion":  # the right factor Q: n × r of the tensor as (shape[0], rest)
            from geomopt.optim.units.directions import dion_rank

            cols = n // t.shape[0]
            total += cols * dion_rank(pp.direction["rank"], (t.shape[0], cols)) * size
        if pp.geometry["kind"] == "adam":
            total += 2 * n * size  # exp_avg, exp_avg_sq
        if pp.geometry["kind"] == "kronecker" and pp.geometry["method"] == "psgd":  # Q_L, Q_R and the momentum
            rows, limit = pp.op_shape[0], pp.geometry["max_dim"]
            total += sum(k if k == 1 or (limit is not None and k > limit) else k * k for k in (rows, n // rows)) * 4
            total += n * size
        elif pp.geometry["kind"] == "kronecker":  # per (shape[0], rest) matrix: factors and their roots or bases
            rows = pp.op_shape[0]
            sides = [k for k in (rows, n // rows) if pp.geometry["max_dim"] is None or k <= pp.geometry["max_dim"]]
            total += 2 * sum(k * k for k in sides) * 4
            if pp.geometry["method"] == "soap":
                total += 2 * n * size  # Adam's moments
            elif pp.geometry["graft"] in ("adagrad", "adam"):
                total += n * 4  # the graft's sum of squares
        for stage in pp.post:
            if stage["kind"] == "second_moment":
                total += _second_moment_numel(stage["axis"], pp) * size  # post_v
            elif stage["kind"] == "norm_ratio":
                total += size  # post_g2: one number per tensor
    return total


def _second_moment_numel(axis: str, pp) -> int:
    """Entries of a second moment: one per entry, per row of each matrix, or per column of each
    matrix (each row block its own) of the tensor's view."""
    shape, view = pp.op_shape, pp.geometry.get("view")
    n = 1
    for d in shape:
        n *= d
    if axis == "element":
        return n
    b = view["batch"] if view else 0
    if axis == "longer":  # rows where the (first) matrix has at least as many rows as columns
        rows = ((view or {}).get("blocks") or [shape[b]])[0]
        cols = shape[b + 1] if view and view["trailing"] == "batch" else n // (shape[b] * max(1, _prod(shape[:b])))
        axis = "row" if rows >= cols else "column"
    if axis == "row":
        cols = shape[b + 1] if view and view["trailing"] == "batch" else n // (shape[b] * max(1, _prod(shape[:b])))
        return n // cols
    blocks = (view or {}).get("blocks") or [shape[b]]
    return n // shape[b] * len(blocks)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


#: 0-dim int64 step counts (torch keeps its ``step`` a tensor): counters, not the algorithm's state
COUNT_KEYS = tuple(f"state.{k}" for k in COUNTS)  # the declared step counts


def state_bytes(held: dict) -> int:
    """The bytes of the held state, less its step counts."""
    return sum(b for b, name in held.values() if name.startswith("state") and name not in COUNT_KEYS)


def count_bytes(held: dict) -> int:
    return sum(b for b, name in held.values() if name in COUNT_KEYS)


def staged_momentum_bytes(opt, model) -> int:
    """An isotropic rule's new momentum is formed whole in the workspace before its norms (a step
    that fails there writes nothing): the largest such rule's momentum bytes."""
    named = dict(model.named_parameters())
    sizes: dict = {}
    for pp in opt.plan:
        if pp.geometry["kind"] == "isotropic" and pp.direction["kind"] != "none":
            t = named[pp.name]
            sizes[pp.rule] = sizes.get(pp.rule, 0) + t.numel() * max(t.element_size(), 4)
    return max(sizes.values(), default=0)


def largest_bucket_bytes(opt, model) -> int:
    named = dict(model.named_parameters())
    sizes: dict = {}
    for pp in opt.plan:
        t = named[pp.name]
        sizes[pp.bucket] = sizes.get(pp.bucket, 0) + t.numel() * max(t.element_size(), 4)
    return max(sizes.values())


def held_after_steps(model, loss, spec, steps=3, **kw):
    opt = geomopt.GeomOptimizer(model, spec, **kw)
    if any(pp.qk_clip is not None for pp in opt.plan):  # QK-clip reads the logits an attention monitor keeps
        geomopt.monitor_attention(model)
    workspace, during = opt.engine.rt.workspace, []  # its size at the end of each step, before its release
    release = workspace.release
    workspace.release = lambda: during.append(workspace.nbytes) or release()
    workspace.during = during
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if any(g["direction"] == "storm" for g in opt.param_groups):
            def closure(step=step):
                opt.zero_grad(set_to_none=True)
                value = loss(step)
                value.backward()
                return value
            opt.step(closure)
        else:
            loss(step).backward()
            opt.step()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return opt, held_storages(opt, exclude)


# every shipped spec on two models, the digits and grokking examples too, whose name rules ('head.weight')
# are for other models: their unused rules warn (GO102), which is not what this test measures
@pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")
@pytest.mark.parametrize("model_fn", [_gpt, _llama], ids=["gpt", "hf-llama"])
@pytest.mark.parametrize("spec", SHIPPED)
def test_held_memory_is_the_state_and_nothing_of_the_steps_scratch(spec, model_fn):
    model, loss = model_fn()
    opt, held = held_after_steps(model, loss, str(ROOT / spec))
    state = state_bytes(held)
    workspace = sum(b for b, name in held.values() if name.startswith("workspace"))
    other = {name: b for b, name in held.values() if not name.startswith(("state", "workspace", "counters"))}
    assert state == expected_state_bytes(opt, model), {name: b for b, name in held.values()}
    assert not other, other  # no kept buffer outside the state and the workspace
    assert workspace == 0, workspace  # released at the end of the step
    during = max(opt.engine.rt.workspace.during)  # and bounded by the largest bucket while a step runs
    bound = max(largest_bucket_bytes(opt, model), staged_momentum_bytes(opt, model))
    assert during <= bound, (during, bound)
    # an int64 per step count a tensor keeps at most (often shared by its bucket): one, or two where
    # an Adam geometry's count and the post-stages' are both kept (LAMB)
    counts = sum(len(set(COUNTS) & set(st)) for st in opt.state.values())
    assert count_bytes(held) <= 8 * counts
    assert sum(b for b, name in held.values() if name.startswith("counters")) < 64  # a few scalars


def moments_numel(opt, model) -> list:
    """The entry counts of every moment the plan keeps (a direction's momentum, Adam's two), one per
    moment and tensor: what a rule's state precision encodes."""
    named = dict(model.named_parameters())
    out = []
    for pp in opt.plan:
        n = named[pp.name].numel()
        out += [n] * ((pp.direction["kind"] != "none") + 2 * (pp.geometry["kind"] == "adam"))
    return out


#: bytes per entry of a moment kept in each precision, where int8 quantizes it (a size that is a
#: multiple of 256): codes, a float32 scale per 256 entries, and int8-ec's 4-bit corrections
PER_ENTRY = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256, "int8-ec": 1 + 4 / 256 + 1 / 2}


@pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int8-ec"])
@pytest.mark.parametrize("model_fn", [_gpt, _llama], ids=["gpt", "hf-llama"])
def test_held_memory_in_a_state_precision_is_its_bytes_per_entry(model_fn, dtype):
    """Muon's state in each precision, counted from the plan: every moment at the precision's bytes
    per entry (int8's: only a size that is a multiple of 256, the rest float32), nothing else kept."""
    model, loss = model_fn()
    spec = {"geomopt": 1, "name": f"muon-{dtype}", "extends": str(ROOT / "specs" / "muon.yaml"),
            "defaults": {"state": dtype}}
    opt, held = held_after_steps(model, loss, spec)
    sizes = moments_numel(opt, model)
    want = sum(n * (PER_ENTRY[dtype] if dtype == "bfloat16" or n % 256 == 0 else 4) for n in sizes)
    assert any(n % 256 == 0 for n in sizes)  # int8 quantizes some of them
    assert state_bytes(held) == want, {name: b for b, name in held.values()}
    assert sum(b for b, name in held.values() if name.startswith("workspace")) == 0


def test_storm_and_nesterov_keep_only_their_state():
    """STORM keeps d and the previous iterate; a Nesterov look-ahead and a sign map's output live
    in the step's workspace, not per tensor, and not between steps."""
    model, loss = _gpt()
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.01}, "rules": [
        {"name": "hidden", "match": {"name": "**.weight", "ndim": 2}, "direction": {"kind": "storm", "alpha": 0.2},
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}},
        {"name": "rest", "match": "**", "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True},
         "geometry": {"kind": "anisotropic", "reference": {"kind": "indicator"}}}]}
    opt, held = held_after_steps(model, loss, spec)
    state = state_bytes(held)
    assert state == expected_state_bytes(opt, model)
    assert {name for _, name in held.values()} <= {"state.d", "state.prev", "counters.fallbacks",
                                                    "counters.update_sq"}


FLAT = {
    "sign-nesterov": ({"kind": "anisotropic", "reference": {"kind": "indicator"}},
                      {"kind": "polyak", "alpha": 0.1, "nesterov": True}),
    "sign-momentum": ({"kind": "anisotropic", "reference": {"kind": "indicator"}}, {"kind": "polyak", "alpha": 0.1}),
    "sign-plain": ({"kind": "anisotropic", "reference": {"kind": "indicator"}}, {"kind": "none"}),
    "isotropic-nesterov": ({"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-8}},
                           {"kind": "polyak", "alpha": 0.1, "nesterov": True}),
    "adam-unfused": ({"kind": "adam"}, {"kind": "none"}),
    "adam-nesterov": ({"kind": "adam"}, {"kind": "polyak", "alpha": 0.1, "nesterov": True}),
}


@pytest.mark.parametrize("name", list(FLAT))
def test_flat_blocks_give_the_same_bits_as_one_pass(name, monkeypatch):
    """The flat path block by block (row ranges of a few thousand entries here, so blocks cut
    tensors and hold several) equals the same path in one block, bit for bit, over steps with a
    missing gradient; the scratch is one block."""
    import geomopt.optim.engine.flat as optimizer_module
    from optim_helpers import step_in_lockstep, tiny_gpt

    geometry, direction = FLAT[name]
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.01, "weight_decay": 0.1},
            "rules": [{"name": "all", "match": "**", "geometry": geometry, "direction": direction}]}
    models = [tiny_gpt(0), tiny_gpt(0)]
    implementation = "foreach" if name == "adam-unfused" else "auto"
    opts = [geomopt.GeomOptimizer(m, copy.deepcopy(spec), implementation=implementation) for m in models]
    xs = list(models[0].parameters())
    blocks = optimizer_module.flat_blocks(xs, 3000)
    assert any(a is not None for pieces, _, _ in blocks for _, a, _ in pieces)  # tensors are cut
    assert any(len(pieces) > 1 for pieces, _, _ in blocks)  # blocks hold several pieces
    cut = [t for pieces, _, _ in blocks for t in optimizer_module.cut_pieces([x.detach().reshape(x.shape) for x in xs],
                                                                       pieces)]
    assert torch.equal(torch.cat([t.reshape(-1) for t in cut]), torch.cat([x.detach().reshape(-1) for x in xs]))
    for pieces, off, n in blocks:
        assert n == sum(t.numel() for t in optimizer_module.cut_pieces(xs, pieces))
        assert n <= 3000 or len(pieces) == 1
    whole = sum(p.numel() for p in models[1].parameters())

    def setup(i):
        monkeypatch.setattr(optimizer_module, "BLOCK", 3000 if i == 0 else whole)
        opts[i].engine.rt.largest_bucket = 3000 if i == 0 else whole

    workspace, during = opts[0].engine.rt.workspace, []  # its size at the end of each step, before it is released
    release = workspace.release
    monkeypatch.setattr(workspace, "release", lambda: during.append(workspace.nbytes) or release())
    step_in_lockstep(models, opts, setup=setup)
    assert during and max(during) <= 2 * 3000 * 4 and workspace.nbytes == 0


@pytest.mark.parametrize("axis", ["row", "column", "element"])
def test_post_stage_state_is_one_second_moment_per_row_column_or_entry(axis):
    """A second moment of each axis (on experts-free HF Llama matrices, GPT's in_out projections and
    a conv-like 4-D tensor read as one matrix per kernel position): the state is the momentum plus
    exactly the second moment's entries."""
    model, loss = _llama()
    spec = {"geomopt": 1, "name": "t", "rules": [
        {"name": "hidden", "match": {"role": ["hidden", "expert"]}, "direction": {"kind": "polyak", "alpha": 0.05},
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"},
                      "view": "auto"},
         "post": [{"kind": "second_moment", "axis": axis}, {"kind": "rms_match", "target": 0.2}, {"kind": "cautious"}]},
        {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "direction": {"kind": "lion"},
         "post": [{"kind": "second_moment", "axis": "element"}]},
    ]}
    opt, held = held_after_steps(model, loss, spec)
    state = state_bytes(held)
    assert state == expected_state_bytes(opt, model), {name: b for b, name in held.values()}

    conv = torch.nn.Conv2d(3, 8, 3)
    spec = {"geomopt": 1, "name": "c", "rules": [{"name": "k", "match": "weight", "post": [{"kind": "second_moment", "axis": axis}],
                                                  "geometry": {"kind": "spectral", "reference": {"kind": "indicator"},
                                                               "view": {"kind": "matrix", "trailing": "batch"}}},
                                                 {"name": "b", "match": "bias", "geometry": {"kind": "euclidean"}}]}
    opt, held = held_after_steps(conv, lambda step: conv(torch.randn(2, 3, 6, 6)).square().mean(), spec)
    state = state_bytes(held)
    assert state == expected_state_bytes(opt, conv) == _second_moment_numel(axis, opt.plan["weight"]) * 4
