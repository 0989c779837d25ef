"""The forward tracer (geomopt.compile.trace) against small hand-built modules, one op family at a
time: each module's tensors are classified by what the forward does with them, asserted tensor by
tensor; then heads, stems and output blocks; then that tracing leaves the model exactly as it was
and that every way a trace can fail falls back to the module tree and says why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from geomopt.compile.fragments import plain
import geomopt
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.trace.families import FAMILIES
from geomopt.compile.roles.guess import guess_roles
from geomopt.compile.trace.forward import TraceError, trace_model
from geomopt.compile.trace.inputs import Inputs, as_inputs

from test_match import _Tied


def traced(model: nn.Module, *args, **kwargs):
    return trace_model(model, Inputs(args, kwargs))


def families(trace) -> dict[str, set]:
    return {n: set(t.uses) for n, t in trace.tensors.items()}


def roles(model: nn.Module, inputs) -> dict[str, str]:
    infos, _ = model_params(model, example_inputs=inputs)
    return {p.name: p.role.name for p in infos}


# ---------------------------------------------------------------- one op family at a time


class Families(nn.Module):
    """Every family once: a linear layer, x @ W, einsum, a full and a depthwise convolution, a
    lookup, an indexed table, elementwise-only tensors (a scale, exp(A_log), a LayerNorm)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.w_at = nn.Parameter(torch.randn(8, 8))  # x @ w_at
        self.w_einsum = nn.Parameter(torch.randn(8, 8))
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.depthwise = nn.Conv1d(8, 8, 3, padding=1, groups=8, bias=False)
        self.table = nn.Parameter(torch.randn(7, 8))  # rows gathered by index, then added
        self.scale = nn.Parameter(torch.ones(1, 1, 8))
        self.A_log = nn.Parameter(torch.zeros(8, 4))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, 8)
        x = self.lin(x) @ self.w_at
        x = torch.einsum("btd,ed->bte", x, self.w_einsum)
        x = self.conv(x.transpose(1, 2))
        x = self.depthwise(x).transpose(1, 2)
        pos = torch.arange(idx.shape[1], device=idx.device) % 7
        x = x + self.table[pos] + x * self.scale
        x = x * torch.exp(-self.A_log.exp()).sum(-1)
        return self.head(self.norm(x))


def test_each_family_is_recognised():
    torch.manual_seed(0)
    t = traced(Families(), torch.zeros(1, 4, dtype=torch.long))
    assert t.device == "meta"
    got = families(t)
    assert got == {
        "embed.weight": {"lookup"},
        "lin.weight": {"matmul"}, "lin.bias": {"elementwise"},
        "w_at": {"matmul"},
        "w_einsum": {"matmul"},
        "conv.weight": {"conv"}, "conv.bias": {"elementwise"},
        "depthwise.weight": {"grouped_conv"},
        "table": {"indexed"},
        "scale": {"elementwise"},
        "A_log": {"elementwise"},
        "norm.weight": {"elementwise"}, "norm.bias": {"elementwise"},
        "head.weight": {"matmul"}, "head.bias": {"elementwise"},
    }
    assert t.tensors["depthwise.weight"].uses["grouped_conv"].detail == "groups=8"
    assert {n for n, x in t.tensors.items() if x.head} == {"head.weight"}
    assert t.tensors["embed.weight"].stem == "token"


def test_family_roles_over_the_module_tree():
    """The roles the families give: matrices hidden, the lookup embedding, the last layer head,
    and everything else never a matrix role (the module tree called table and A_log hidden
    matrices)."""
    got = roles(Families(), torch.zeros(1, 4, dtype=torch.long))
    assert got == {
        "embed.weight": "embedding",
        "lin.weight": "hidden", "lin.bias": "bias",
        "w_at": "hidden", "w_einsum": "hidden", "conv.weight": "hidden", "conv.bias": "bias",
        "depthwise.weight": "other", "table": "other", "scale": "other", "A_log": "other",
        "norm.weight": "norm", "norm.bias": "norm",
        "head.weight": "head", "head.bias": "bias",
    }
    infos, _ = model_params(Families(), example_inputs=torch.zeros(1, 4, dtype=torch.long))
    by = {p.name: p.role for p in infos}
    assert by["A_log"].basis == "trace" and by["A_log"].inferred.startswith("hidden")
    assert by["A_log"].evidence == "used only elementwise (mul)"  # exp(A_log) multiplies the activations
    # the module tree knows a grouped convolution's kernel too: both say other
    assert by["depthwise.weight"].inferred is None and "groups=8" in by["depthwise.weight"].evidence
    assert by["table"].inferred.startswith("hidden") and "indexed" in by["table"].evidence
    assert by["lin.weight"].inferred is None  # trace and module tree agree


def test_every_family_is_documented():
    assert set(FAMILIES) == {"matmul", "conv", "grouped_conv", "lookup", "indexed", "elementwise"}
    for fam in FAMILIES.values():
        assert fam.doc and fam.name in fam.doc, fam.name
    text = geomopt.compile.roles.assign.role_docs()
    assert all(f"``{name}``" in text for name in FAMILIES)


class Experts(nn.Module):
    """A stack of expert matrices picked by an index (select, then index) and multiplied."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 16, 8))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        e = self.router(x).argmax(-1)
        y = torch.bmm(x.unsqueeze(1), self.experts[e].transpose(1, 2)).squeeze(1)  # gathered by index
        return self.head(y + x @ self.experts[1].t())  # one expert, selected


def test_indexed_then_multiplied_is_a_stack_of_matrices():
    t = traced(Experts(), torch.zeros(2, 8))
    e = t.tensors["experts"]
    assert "matmul" in e.uses and e.batched
    assert "through select/index" in e.uses["matmul"].detail


# ---------------------------------------------------------------- heads and stems


class TwoOutputs(nn.Module):
    """A trunk and two heads (class logits and a 3-layer box MLP): each output's last layer is a
    head, the MLP's first two are not."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.cls = nn.Linear(8, 4)
        self.box = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return {"logits": self.cls(h), "pred_boxes": self.box(h).sigmoid(), "last_hidden_state": h}


def test_heads_are_the_layers_producing_outputs():
    got = roles(TwoOutputs(), torch.zeros(2, 8))
    assert {n for n, r in got.items() if r == "head"} == {"cls.weight", "box.4.weight"}
    assert got["box.0.weight"] == got["box.2.weight"] == got["trunk.weight"] == "hidden"
    t = traced(TwoOutputs(), torch.zeros(2, 8))
    assert t.outputs == ("logits", "pred_boxes")  # the hidden state is not a prediction
    assert (t.tensors["cls.weight"].head, t.tensors["box.4.weight"].head) == ("logits", "pred_boxes")


class Tied(_Tied):
    """test_match's tied model (an embedding and a head sharing a weight) with a forward."""

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.body(self.wte(idx))))


def test_a_tied_table_is_embedding_and_head():
    got = roles(Tied(), torch.zeros(1, 3, dtype=torch.long))
    assert got == {"wte.weight": "embedding+head", "body.weight": "hidden", "body.bias": "bias"}


class Backbone(nn.Module):
    """A residual stack with no prediction output: the last layer feeding the final state is the
    head (as the module tree's last-layer rule says), every other layer feeds a later one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return {"last_hidden_state": x}


def test_a_backbone_has_its_last_layer_as_head():
    got = roles(Backbone(), torch.zeros(2, 8))
    assert [got[f"layers.{i}.weight"] for i in range(3)] == ["hidden", "hidden", "head"]


class Stems(nn.Module):
    """A patchifying conv (kernel = stride) and a 1-D conv over frames read raw inputs (stems:
    embeddings); an overlapping 2-D conv reading pixels is an ordinary matrix, like ResNet's."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.frames = nn.Conv1d(6, 8, 3, padding=1)
        self.pixels = nn.Conv2d(3, 8, 3, padding=1)
        self.out = nn.Linear(8, 2)

    def forward(self, img, audio):
        a = self.patch(img).flatten(2).mean(-1)
        b = self.frames(audio).mean(-1)
        c = self.pixels(img).flatten(2).mean(-1)
        return self.out(a + b + c)


def test_stems_read_the_raw_input():
    model = Stems()
    inputs = (torch.zeros(1, 3, 8, 8), torch.zeros(1, 6, 5))
    t = trace_model(model, as_inputs(inputs))
    assert (t.tensors["patch.weight"].stem, t.tensors["frames.weight"].stem, t.tensors["pixels.weight"].stem) == (
        "patch", "audio", None)
    assert t.tensors["pixels.weight"].reads_input and not t.tensors["out.weight"].reads_input
    got = roles(model, inputs)
    assert (got["patch.weight"], got["frames.weight"], got["pixels.weight"]) == ("embedding", "embedding", "hidden")


# ---------------------------------------------------------------- output blocks


class Fused(nn.Module):
    """Fused projections cut every way models cut them."""

    def __init__(self):
        super().__init__()
        self.qkv_split = nn.Linear(8, 24)  # .split(8, -1): GPT-2
        self.gate_up = nn.Linear(8, 12)  # .chunk(2, -1): ModernBERT's Wi, Phi-3's gate_up
        self.qkv_gqa = nn.Linear(8, 16)  # slices 8 | 4 | 4: Phi-3's qkv_proj under GQA
        self.qkv_unflatten = nn.Linear(8, 24)  # view(…, 3, 8) then [0], [1], [2]: nn.MultiheadAttention
        self.glu = nn.Linear(8, 16)  # F.glu halves
        self.interleaved = nn.Linear(8, 24)  # view(…, heads 2, 3, 4): q, k, v interleaved per head (Bloom)
        self.heads = nn.Linear(8, 8)  # view(…, 2, 4) into heads: no cut
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv_split(x).split(8, dim=-1)
        g, u = self.gate_up(x).chunk(2, dim=-1)
        y = self.qkv_gqa(x)
        a, b, c = y[..., :8], y[..., 8:12], y[..., 12:]
        z = self.qkv_unflatten(x).unflatten(-1, (3, 8)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        z0, z1, z2 = z[0], z[1], z[2]
        w = F.glu(self.glu(x), dim=-1)
        i = self.interleaved(x).view(*x.shape[:-1], 2, 3, 4)
        iq, ik = i[..., 0, :].flatten(-2), i[..., 1, :].flatten(-2)
        h = self.heads(x).view(*x.shape[:-1], 2, 4).transpose(-2, -3).sum(-3)
        s = q + k + v + z0 + z1 + z2 + w + iq + ik + (a + torch.cat([b, c], -1)) + torch.cat([h, h], -1)
        return self.out(s + torch.cat([g * u, g], -1)[..., :8])


def test_blocks_from_the_cuts_of_each_output():
    t = traced(Fused(), torch.zeros(2, 3, 8))
    blocks = {n.removesuffix(".weight"): x.blocks for n, x in t.tensors.items() if n.endswith("weight")}
    assert blocks == {"qkv_split": [8, 8, 8], "gate_up": [6, 6], "qkv_gqa": [8, 4, 4],
                      "qkv_unflatten": [8, 8, 8], "glu": [8, 8], "interleaved": None, "heads": None, "out": None}
    infos, _ = model_params(Fused(), example_inputs=torch.zeros(2, 3, 8))
    structures = {p.name: p.role.structure for p in infos if p.role.structure}
    assert structures == {"qkv_split.weight": {"batch": 0, "blocks": [8, 8, 8]},
                          "gate_up.weight": {"batch": 0, "blocks": 2},  # the name's inference, same cut
                          "qkv_gqa.weight": {"batch": 0, "blocks": [8, 4, 4]},
                          "qkv_unflatten.weight": {"batch": 0, "blocks": [8, 8, 8]},
                          "glu.weight": {"batch": 0, "blocks": [8, 8]}}


def test_trace_blocks_reach_the_muon_view():
    plan = geomopt.compile_spec("muon", Fused(), example_inputs=torch.zeros(2, 3, 8))
    view = plan["qkv_gqa.weight"].geometry["view"]
    assert view.blocks == (8, 4, 4)
    assert plan["interleaved.weight"].geometry["view"] is None


# ---------------------------------------------------------------- the model is left as it was


class Stateful(nn.Module):
    """BatchNorm statistics, dropout (RNG) and a data-dependent branch that the meta device cannot
    take (``.item()`` on a value that must be positive), so the real forward runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.bn(self.lin(x))
        if float(h.abs().sum().item()) <= 0.0 and x.abs().sum().item() > 0:
            raise RuntimeError("impossible on real data")
        if x.abs().sum().item() == 0:  # the meta device's stand-in value: take a path real data never does
            raise RuntimeError("needs real values")
        return self.head(self.drop(h))


def test_the_real_forward_leaves_everything_as_it_was():
    torch.manual_seed(0)
    model = Stateful().train()
    x = torch.randn(4, 8)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    model.lin.weight.grad = None
    t = traced(model, x)
    assert t.device == "cpu" and "meta device" in t.notes[0] and "needs real values" in t.notes[0]
    assert {n for n, v in t.tensors.items() if v.head} == {"head.weight"}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics included
    assert int(after["bn.num_batches_tracked"]) == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert model.training


class ClampsItsWeight(nn.Module):
    """A forward that clamps its weight in place (through the parameter, or its ``.data``), and
    that the meta device cannot run (a value read on the host)."""

    def __init__(self, through_data: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.head = nn.Linear(8, 2)
        self.through_data = through_data

    def forward(self, x):
        if x.sum().item() == 0:
            raise RuntimeError("needs real values")
        with torch.no_grad():
            (self.w.data if self.through_data else self.w).clamp_(-0.1, 0.1)
        return self.head(x @ self.w)


@pytest.mark.parametrize("through_data", [False, True])
def test_a_forward_writing_to_a_parameter_is_stopped_before_it_writes(through_data):
    model = ClampsItsWeight(through_data)
    before = copy.deepcopy(model.state_dict())
    infos, _ = model_params(model, example_inputs=torch.ones(2, 8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    w = infos[0]
    assert w.name == "w" and w.role.basis == "module tree" and w.role.name == "hidden"
    assert "writes in place to parameter 'w' (aten.clamp_.default)" in w.role.untraced
    # writing to a buffer (the trace's copy), or to a tensor the forward made, is no write to the model
    other = ClampsItsWeight(through_data)
    other.register_buffer("scale", torch.ones(8))
    other.forward = lambda x: other.head((x @ other.w).mul_(other.scale.add_(x.sum().item())))
    assert {p.role.basis for p in model_params(other, example_inputs=torch.ones(2, 8))[0]} == {"trace"}
    assert torch.equal(other.scale, torch.ones(8))


def test_a_meta_forward_leaves_the_model_untouched():
    model = Families()
    before = copy.deepcopy(model.state_dict())
    traced(model, torch.zeros(1, 4, dtype=torch.long))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- no trace: the fallback says why


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        raise ValueError("this forward always fails")


def _untraced(model, inputs=None) -> set:
    infos, _ = model_params(model, example_inputs=inputs)
    assert all(p.role.basis == "module tree" for p in infos)
    return {p.role.untraced for p in infos}


def test_fallbacks_name_their_reason():
    (why,) = _untraced(Broken(), torch.zeros(1, 8))
    assert "this forward always fails" in why and "meta device" in why and "on cpu" in why
    (why,) = _untraced(Broken())
    assert why.startswith("no example inputs")
    with torch.device("meta"):
        meta_model = Stateful()
    (why,) = _untraced(meta_model, torch.zeros(4, 8))
    assert "meta device" in why and "on cpu" not in why  # a model on meta has no real forward to try
    # the roles are the module tree's: the last layer is the head
    infos, _ = model_params(Broken(), example_inputs=torch.zeros(1, 8))
    assert {p.name: p.role.name for p in infos}["head.weight"] == "head"


def test_a_forward_failing_everywhere_says_its_own_error_once():
    """Meta and real, in training and in eval mode: four tries, one error, said once with where."""
    with pytest.raises(TraceError) as caught:
        traced(Broken(), torch.zeros(1, 8))
    text = str(caught.value)
    assert text.count("ValueError: this forward always fails") == 1
    assert "on the meta device, on the meta device in eval mode, on cpu, on cpu in eval mode" in text


class PooledBatchNorm(nn.Module):
    """BatchNorm on a pooled 1×1 map (a squeeze-excitation block's): training refuses a batch of one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.bn(self.conv(x).mean((2, 3), keepdim=True)).flatten(1))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_batchnorm_on_one_row_is_traced_in_eval_mode(device, monkeypatch):
    model = PooledBatchNorm()
    before = copy.deepcopy(model.state_dict())
    if device == "cpu":  # the meta forward unavailable: the real one is retried in eval mode too
        monkeypatch.setattr("geomopt.compile.trace.forward._run", _only_real(trace_model.__globals__["_run"]))
    t = traced(model, torch.zeros(1, 3, 5, 5))
    assert t.device == device and "Expected more than 1 value per channel" in " ".join(t.notes)
    assert t.tensors["conv.weight"].uses and t.tensors["head.weight"].head == "output"
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # running stats untouched


def _only_real(run):
    def real_only(model, names, params, buffers, args, kwargs, meta):
        if meta:
            raise RuntimeError("no meta kernel")
        return run(model, names, params, buffers, args, kwargs, meta)

    return real_only


class NotMatrices(nn.Module):
    """Tensors of ≥ 2 dims that are no matrix: a depthwise kernel, a single row, a single column."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, 8))
        self.pool = nn.Linear(8, 1)  # an attention-pooling score
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8)
        self.full = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 2)


def test_the_module_tree_knows_what_is_no_matrix():
    """Without a trace: a grouped convolution's kernel and a single row or column are other, with
    the reason; a full convolution stays hidden, a one-output last layer stays the head."""
    infos, _ = model_params(NotMatrices())
    by = {p.name: p.role for p in infos}
    assert {n: r.name for n, r in by.items() if n.endswith(("weight", "query"))} == {
        "depthwise.weight": "other", "full.weight": "hidden", "query": "other", "pool.weight": "other",
        "head.weight": "head"}
    assert by["depthwise.weight"].evidence == "a grouped convolution's kernel (Conv2d, groups=8)"
    assert by["query"].evidence == "a single row (1×1×8): a vector"
    assert by["pool.weight"].evidence == "a single row (1×8): a vector"
    # from names and shapes alone (a checkpoint): the single row and column too
    guessed = guess_roles(model_params(list(NotMatrices().named_parameters()))[0])
    assert {n: guessed[n].name for n in ("query", "pool.weight", "full.weight")} == {
        "query": "other", "pool.weight": "other", "full.weight": "hidden"}


def test_a_failing_forward_never_breaks_the_optimizer_and_lint_says_why():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = geomopt.GeomOptimizer(Broken(), "muon", example_inputs=torch.zeros(1, 8))
    assert {pp.name: pp.role for pp in opt.plan}["lin.weight"] == "hidden"
    infos, _ = model_params(Broken(), example_inputs=torch.zeros(1, 8))
    notes = [d for d in lint_spec(geomopt.load_spec("muon"), infos) if d.code == "GO124"]
    assert len(notes) == 1 and "this forward always fails" in notes[0].message and notes[0].severity == "note"


@pytest.mark.parametrize("bad", [3, "tokens", object(), {1: torch.zeros(1)}])
def test_unusable_example_inputs_are_refused_saying_what_is_expected(bad):
    with pytest.raises(TypeError, match="example_inputs must be a tensor, a tuple|argument names"):
        geomopt.GeomOptimizer(Broken(), "muon", example_inputs=bad)


def test_example_inputs_in_every_form():
    model, x = TwoOutputs(), torch.zeros(2, 8)
    expected = roles(model, x)
    for form in ((x,), [x], {"x": x}, ((x,), {}), lambda: x, Inputs((x,), {})):
        assert roles(model, form) == expected


def test_a_module_tree_head_that_the_trace_refutes():
    """A module whose last-registered layer is not where outputs come from: the module tree calls
    the last registered layer the head; the trace names the real one."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(8, 3)
            self.inner = nn.Linear(8, 8)  # registered last, used first

        def forward(self, x):
            return self.out(torch.relu(self.inner(x)))

    got = roles(Odd(), torch.zeros(1, 8))
    assert (got["out.weight"], got["inner.weight"]) == ("head", "hidden")
    untraced = {p.name: p.role.name for p in model_params(Odd())[0]}
    assert untraced["inner.weight"] == "head"  # what the fallback would have done


def test_explain_shows_both_verdicts():
    from geomopt.compile.explain import explain

    model, x = Families(), torch.zeros(1, 4, dtype=torch.long)
    infos, _ = model_params(model, example_inputs=x)
    spec = geomopt.load_spec("muon")
    plan = geomopt.compile_spec(spec, model, example_inputs=x)
    text = explain(spec, infos, list(plan), "A_log")
    assert "role       other (traced): used only elementwise (mul)" in text
    assert "the module tree said hidden" in text
    text = explain(spec, model_params(Broken())[0], list(geomopt.compile_spec(spec, Broken())), "lin.weight")
    assert "(inferred without a trace)" in text and "no trace: no example inputs" in text


def test_wrapped_models_are_traced_through_their_wrappers():
    """torch.compile and activation checkpointing: the trace runs the wrapped module's own forward
    and its names are the plain model's, so the roles are the plain model's, decided by use."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from geomopt.models import get_model

    plain = {p.name: (p.role.name, p.role.basis) for p in model_params(get_model("gpt"))[0]}
    assert {b for _, b in plain.values()} == {"trace"}
    checkpointed = get_model("gpt")
    apply_activation_checkpointing(checkpointed, check_fn=lambda mod: type(mod).__name__ == "Block")
    for wrapped in (torch.compile(get_model("gpt")), checkpointed):
        assert {p.name: (p.role.name, p.role.basis) for p in model_params(wrapped)[0]} == plain


# ---------------------------------------------------------------- repeated blocks replayed


def _deep_models():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2)
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**small)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=5, n_embd=32, n_head=4, vocab_size=64, n_positions=16)),
        "mixtral": lambda: t.MixtralForCausalLM(t.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)),
        "mamba": lambda: t.MambaForCausalLM(t.MambaConfig(vocab_size=64, hidden_size=32, state_size=8,
                                                          num_hidden_layers=5)),
        "whisper": lambda: t.WhisperForConditionalGeneration(t.WhisperConfig(
            vocab_size=64, d_model=32, encoder_layers=5, decoder_layers=5, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
            max_source_positions=8, max_target_positions=16, pad_token_id=0, decoder_start_token_id=1)),
        "swin": lambda: t.SwinForImageClassification(t.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[5, 2], num_heads=[2, 2], window_size=4, num_labels=5)),
        "gpt": lambda: geomopt.models.get_model("gpt-bench-x4"),
    }


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral", "mamba", "whisper", "swin", "gpt"])
def test_replayed_blocks_give_the_trace_of_running_them(arch, monkeypatch):
    """A model's later identical blocks are replayed from the summary of the earlier ones: the
    trace (every tensor's uses, head, stem, blocks) is exactly the one running every block gives."""
    from geomopt.compile.trace import forward

    torch.manual_seed(0)
    model = _deep_models()[arch]()
    inputs = geomopt.compile.trace.inputs.default_inputs(model)
    forward._CACHE.clear()
    replayed = trace_model(model, inputs)
    monkeypatch.setattr(forward, "REPLAY", False)
    forward._CACHE.clear()
    full = trace_model(model, inputs)
    assert replayed.replayed > 0 and full.replayed == 0
    assert replayed.tensors == full.tensors
    assert all("forward" not in vars(m) for m in model.modules())  # the patches are gone


def test_blocks_that_differ_are_not_replayed():
    """Blocks with the same parameters whose forward uses them differently (every other block
    skips its projection) never confirm a summary: each runs."""

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i
            self.proj = nn.Linear(8, 8)
            self.gate = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x + (self.proj(x) if self.i % 2 else x * self.gate)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(i) for i in range(6))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    t = traced(Net(), torch.zeros(1, 8))
    assert t.replayed == 0
    assert [set(t.tensors[f"blocks.{i}.proj.weight"].uses) for i in range(6)] == [set(), {"matmul"}] * 3


def test_inputs_that_cannot_be_built_from_a_config_name_the_reason():
    """A Hugging Face-shaped model whose config the input builder cannot read: the roles fall back
    and say what failed, not "no example inputs"."""
    import types

    model = Broken()
    model.config = types.SimpleNamespace(max_source_positions="many")
    model.main_input_name = "input_features"
    (why,) = _untraced(model)
    assert why.startswith("building Broken's example inputs raised ValueError")
