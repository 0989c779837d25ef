"""Routing tables, tensor by tensor, for models written by others whose tensors the forward cuts or
looks up: torch's ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (fused gates per layer), ``nn.Transformer``
(encoder-decoder: cross-attention's ``in_proj_weight`` split into q and k, v),
``nn.MultiheadAttention`` as a pooling head (a learned (1, 1, d) query token), a raw (3, 64, 64)
parameter used through ``einsum``, a decomposed relative-position table (ViTDet's and SAM's
``rel_pos[index]`` multiplied by the queries, directly and interpolated first), a normalized
latent table, a table indexed by the input and experts picked by routed ids, and from tiny
transformers configs T5 (its ``relative_attention_bias`` is an ``nn.Embedding``) and SAM's vision
encoder (decomposed ``rel_pos_h``/``rel_pos_w`` tables); random init, no download.

Each role and each matrix view is written by hand with its reason; every shipped spectral spec
must give the spectral geometry exactly to the hidden matrices, each cut into the matrices the
forward multiplies by (the oracle: no wrong-spectral tensor, none missed), and every shipped spec
lints clean.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import geomopt
from geomopt.compile import compile_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.explain import explain
from geomopt.geometry.view import describe

from test_routing import ALL_SPECS, NOT_SPECTRAL, SPECTRAL, SPECTRAL_SPECS, _transformers, spec_findings

ROOT = Path(__file__).resolve().parents[1]


class RecurrentLM(nn.Module):
    """Tokens → a 2-layer torch RNN (``kind``: LSTM, GRU, RNN) → a vocabulary head."""

    def __init__(self, kind: str, bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = getattr(nn, kind)(16, 24, num_layers=1 if bidirectional else 2, batch_first=True,
                                     bidirectional=bidirectional)
        self.out = nn.Linear(48 if bidirectional else 24, 50)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])

    def example_inputs(self):
        return torch.randint(0, 50, (2, 5))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (one encoder and one decoder layer) between two token tables and a head."""

    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(50, 64)
        self.tgt = nn.Embedding(50, 64)
        self.tr = nn.Transformer(64, 4, 1, 1, 128, dropout=0.0, batch_first=True)
        self.out = nn.Linear(64, 50)

    def forward(self, src, tgt):
        return self.out(self.tr(self.src(src), self.tgt(tgt)))

    def example_inputs(self):
        return torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 4))


class AttentionPool(nn.Module):
    """Features pooled by ``nn.MultiheadAttention`` from one learned query token, then classified."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.query = nn.Parameter(torch.randn(1, 1, 32))
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        h = self.proj(x)
        return self.fc(self.attn(self.query.expand(x.shape[0], -1, -1), h, h)[0][:, 0])

    def example_inputs(self):
        return torch.randn(2, 6, 8)


class TokenQuery(nn.Module):
    """A learned (1, 16) token projected by a layer (the token is the matmul's input, the layer's
    weight its weight), gating features by a one-output layer."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 16))
        self.q = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 1)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.q(self.token.expand(x.shape[0], -1)) * torch.sigmoid(self.gate(x)))

    def example_inputs(self):
        return torch.randn(2, 16)


class SeparateKeyValue(nn.Module):
    """``nn.MultiheadAttention`` given three different tensors: its weight is chunked into q, k, v
    before the three projections."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(8, 32)
        self.v = nn.Linear(8, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 2)

    def forward(self, x):
        k = self.k(x)
        return self.fc(self.attn(k.flip(1), k, self.v(x))[0])

    def example_inputs(self):
        return torch.randn(2, 5, 8)


class EinsumHeads(nn.Module):
    """A raw (3, 64, 64) parameter: one 64 × 64 map per head, applied by ``einsum``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.w = nn.Parameter(torch.randn(3, 64, 64) / 8)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.einsum("bnd,hde->bhne", self.inp(x), self.w).sum(1))

    def example_inputs(self):
        return torch.randn(2, 6, 8)


class RelPosAttention(nn.Module):
    """ViTDet's and SAM's decomposed relative position: a (2n−1, d) table (interpolated first when
    stored at another size), its rows gathered by relative offset and multiplied by the queries;
    a (1, n, d) position table normalized, then added to the tokens."""

    def __init__(self, interpolate: bool = False):
        super().__init__()
        self.interpolate = interpolate
        self.qkv = nn.Linear(16, 48)
        self.rel_pos = nn.Parameter(torch.randn(5 if interpolate else 7, 16))
        self.pos = nn.Parameter(torch.randn(1, 4, 16))
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        x = x + F.layer_norm(self.pos, (16,))
        q, k, v = self.qkv(x).chunk(3, -1)
        rel = self.rel_pos
        if self.interpolate:
            rel = F.interpolate(rel.T[None], size=7, mode="linear")[0].T
        offsets = torch.arange(4)[:, None] - torch.arange(4)[None, :] + 3
        bias = torch.einsum("bqc,qkc->bqk", q, rel[offsets])
        return self.out(self.norm((q @ k.transpose(-1, -2) + bias).softmax(-1) @ v))

    def example_inputs(self):
        return torch.randn(2, 4, 16)


class Tables(nn.Module):
    """A table indexed by the input ids; learned latents normalized, then attended as keys and mixed
    as values; experts (a (4, 16, 16) stack) picked per token by routed ids."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(50, 16))
        self.latents = nn.Parameter(torch.randn(6, 16))
        self.norm = nn.LayerNorm(16)
        self.route = nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(4, 16, 16))
        self.out = nn.Linear(16, 3)

    def forward(self, ids):
        x = self.table[ids]
        x = x + (x @ self.norm(self.latents).T).softmax(-1) @ self.latents
        experts = self.w[self.route(x).argmax(-1)]
        return self.out(torch.einsum("btd,btde->bte", x, experts))

    def example_inputs(self):
        return torch.randint(0, 50, (2, 5))


def _t5():
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0))


def _sam():
    t = _transformers()
    return t.SamVisionModel(t.SamVisionConfig(
        hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
        mlp_dim=64, global_attn_indexes=[0], window_size=0, use_rel_pos=True))


BUILDERS = {
    "lstm": lambda: RecurrentLM("LSTM"), "gru": lambda: RecurrentLM("GRU"), "rnn": lambda: RecurrentLM("RNN"),
    "bilstm": lambda: RecurrentLM("LSTM", bidirectional=True), "transformer": Seq2Seq, "pool": AttentionPool,
    "mha-qkv": SeparateKeyValue, "token": TokenQuery,
    "einsum": EinsumHeads, "relpos": RelPosAttention, "relpos-interpolated": lambda: RelPosAttention(True),
    "tables": Tables, "t5": _t5, "sam": _sam,
}
ARCHS = list(BUILDERS)


@functools.cache
def _built(arch: str):
    torch.manual_seed(0)
    return BUILDERS[arch]()


def build(arch: str):
    if arch in ("t5", "sam"):
        _transformers()  # skips before the cache would remember a failure
    return _built(arch)


def _recurrent(gates: int, layers: int = 2, directions: tuple[str, ...] = ("",)) -> tuple[dict, dict]:
    """A RecurrentLM's roles and hidden views: W_ih and W_hh of each layer hold ``gates`` stacked
    gate matrices (PyTorch's layout: LSTM i, f, g, o; GRU r, z, n; RNN one), each 24 rows."""
    roles = {"emb.weight": "embedding",  # looked up by the token ids
             "out.weight": "head",  # makes the logits, nothing after it
             "out.bias": "bias"}
    views = {}
    for layer in range(layers):
        for d in directions:
            width = 16 if layer == 0 else 24  # layer 0 reads the 16-wide embeddings
            for w, cols in (("ih", width), ("hh", 24)):
                name = f"rnn.weight_{w}_l{layer}{d}"
                roles[name] = "hidden"  # multiplies the input (ih) or the state (hh): a matrix of the body
                views[name] = f"{gates} × 24×{cols}" if gates > 1 else f"24×{cols}"
                roles[f"rnn.bias_{w}_l{layer}{d}"] = "bias"  # added to the gates
    return roles, views


ROLES: dict[str, dict[str, str]] = {}
VIEWS: dict[str, dict[str, str]] = {}
ROLES["lstm"], VIEWS["lstm"] = _recurrent(4)
ROLES["gru"], VIEWS["gru"] = _recurrent(3)
ROLES["rnn"], VIEWS["rnn"] = _recurrent(1)
ROLES["bilstm"], VIEWS["bilstm"] = _recurrent(4, layers=1, directions=("", "_reverse"))

_MHA = {"in_proj_weight": "hidden",  # q, k, v projections fused: three 64 × 64 matrices
        "in_proj_bias": "bias", "out_proj.weight": "hidden", "out_proj.bias": "bias"}
_FFN = {"linear1.weight": "hidden", "linear1.bias": "bias", "linear2.weight": "hidden", "linear2.bias": "bias"}
_LN = {"weight": "norm", "bias": "norm"}  # LayerNorm's scale and shift


def _under(prefix: str, table: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in table.items()}


ROLES["transformer"] = {
    "src.weight": "embedding", "tgt.weight": "embedding",  # looked up by the source and target ids
    **_under("tr.encoder.layers.0.self_attn", _MHA), **_under("tr.encoder.layers.0", _FFN),
    **_under("tr.encoder.layers.0.norm1", _LN), **_under("tr.encoder.layers.0.norm2", _LN),
    **_under("tr.encoder.norm", _LN),
    **_under("tr.decoder.layers.0.self_attn", _MHA),
    # cross-attention: q from the target, k and v from the encoder's memory (the weight is split first)
    **_under("tr.decoder.layers.0.multihead_attn", _MHA), **_under("tr.decoder.layers.0", _FFN),
    **_under("tr.decoder.layers.0.norm1", _LN), **_under("tr.decoder.layers.0.norm2", _LN),
    **_under("tr.decoder.layers.0.norm3", _LN), **_under("tr.decoder.norm", _LN),
    "out.weight": "head", "out.bias": "bias",  # makes the logits
}
VIEWS["transformer"] = {
    "tr.encoder.layers.0.self_attn.in_proj_weight": "3 × 64×64",
    "tr.encoder.layers.0.self_attn.out_proj.weight": "64×64",
    "tr.encoder.layers.0.linear1.weight": "128×64", "tr.encoder.layers.0.linear2.weight": "64×128",
    "tr.decoder.layers.0.self_attn.in_proj_weight": "3 × 64×64",
    "tr.decoder.layers.0.self_attn.out_proj.weight": "64×64",
    "tr.decoder.layers.0.multihead_attn.in_proj_weight": "3 × 64×64",  # q | k | v, not one 192 × 64 matrix
    "tr.decoder.layers.0.multihead_attn.out_proj.weight": "64×64",
    "tr.decoder.layers.0.linear1.weight": "128×64", "tr.decoder.layers.0.linear2.weight": "64×128",
}
ROLES["pool"] = {
    "query": "other",  # a learned (1, 1, 32) token: the attention's query input, not a matrix
    "proj.weight": "hidden", "proj.bias": "bias",  # the input projection, a matrix of the body
    **_under("attn", _MHA),  # q from the token, k and v from the features: three 32 × 32 blocks
    "fc.weight": "head", "fc.bias": "bias",  # makes the class scores
}
VIEWS["pool"] = {"proj.weight": "32×8", "attn.in_proj_weight": "3 × 32×32", "attn.out_proj.weight": "32×32"}
ROLES["mha-qkv"] = {
    "k.weight": "hidden", "k.bias": "bias", "v.weight": "hidden", "v.bias": "bias",  # the inputs' projections
    **_under("attn", _MHA),  # chunked into q, k, v before three separate projections
    "fc.weight": "head", "fc.bias": "bias",
}
VIEWS["mha-qkv"] = {"k.weight": "32×8", "v.weight": "32×8", "attn.in_proj_weight": "3 × 32×32",
                    "attn.out_proj.weight": "32×32"}
ROLES["token"] = {
    "token": "other",  # a learned (1, 16) token: the input of q's matmul, not a 1 × 16 matrix
    "q.weight": "hidden", "q.bias": "bias",
    "gate.weight": "other", "gate.bias": "bias",  # a one-output layer: a single row (1 × 16), a vector
    "fc.weight": "head", "fc.bias": "bias",
}
VIEWS["token"] = {"q.weight": "16×16"}
ROLES["einsum"] = {
    "inp.weight": "hidden", "inp.bias": "bias",  # the input projection
    "w": "hidden",  # three 64 × 64 maps, one per head (einsum contracts its middle dim)
    "head.weight": "head", "head.bias": "bias",
}
VIEWS["einsum"] = {"inp.weight": "64×8", "w": "3 × 64×64"}
ROLES["relpos"] = {
    "rel_pos": "embedding",  # rows looked up by relative offset, then multiplied: a lookup table
    "pos": "other",  # a position table normalized and added to the tokens: data, not a matrix
    "qkv.weight": "hidden", "qkv.bias": "bias",  # fused q, k, v, chunked by the forward
    "norm.weight": "norm", "norm.bias": "norm",
    "out.weight": "head", "out.bias": "bias",
}
VIEWS["relpos"] = {"qkv.weight": "3 × 16×16"}
ROLES["relpos-interpolated"] = ROLES["relpos"]  # the same table, interpolated before its rows are gathered
VIEWS["relpos-interpolated"] = VIEWS["relpos"]
ROLES["tables"] = {
    "table": "embedding",  # rows picked by the input ids
    "latents": "other",  # normalized at its first use (keys), then mixed as values: data, not a weight
    "norm.weight": "norm", "norm.bias": "norm",
    "route.weight": "hidden", "route.bias": "bias",  # scores the experts (a plain layer to the module tree)
    "w": "hidden",  # 4 experts' 16 × 16 matrices, picked per token
    "out.weight": "head", "out.bias": "bias",
}
VIEWS["tables"] = {"route.weight": "4×16", "w": "4 × 16×16"}

_T5_ATTN = {f"{p}.weight": "hidden" for p in "qkvo"}  # separate q, k, v, o projections
ROLES["t5"] = {
    "shared.weight": "embedding+head",  # the token table, tied to the LM head
    **_under("encoder.block.0.layer.0.SelfAttention", _T5_ATTN),
    # T5's relative position buckets: an nn.Embedding looked up by bucket, added to the scores
    "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "embedding",
    "encoder.block.0.layer.0.layer_norm.weight": "norm",
    "encoder.block.0.layer.1.DenseReluDense.wi.weight": "hidden",
    "encoder.block.0.layer.1.DenseReluDense.wo.weight": "hidden",
    "encoder.block.0.layer.1.layer_norm.weight": "norm", "encoder.final_layer_norm.weight": "norm",
    **_under("decoder.block.0.layer.0.SelfAttention", _T5_ATTN),
    "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "embedding",
    "decoder.block.0.layer.0.layer_norm.weight": "norm",
    **_under("decoder.block.0.layer.1.EncDecAttention", _T5_ATTN),
    "decoder.block.0.layer.1.layer_norm.weight": "norm",
    "decoder.block.0.layer.2.DenseReluDense.wi.weight": "hidden",
    "decoder.block.0.layer.2.DenseReluDense.wo.weight": "hidden",
    "decoder.block.0.layer.2.layer_norm.weight": "norm", "decoder.final_layer_norm.weight": "norm",
}
VIEWS["t5"] = {n: ("64×32" if n.endswith("wi.weight") else "32×64" if n.endswith("wo.weight") else "32×32")
               for n, r in ROLES["t5"].items() if r == "hidden"}

_SAM = "vision_encoder.layers.0."
ROLES["sam"] = {
    "vision_encoder.pos_embed": "other",  # a (1, 4, 4, 32) position table added to the patches
    "vision_encoder.patch_embed.projection.weight": "embedding",  # patchifies the pixels (stride = kernel)
    "vision_encoder.patch_embed.projection.bias": "bias",
    **_under(_SAM + "layer_norm1", _LN), **_under(_SAM + "layer_norm2", _LN),
    # decomposed relative positions: rows gathered by offset, then multiplied by the queries
    _SAM + "attn.rel_pos_h": "embedding", _SAM + "attn.rel_pos_w": "embedding",
    _SAM + "attn.qkv.weight": "hidden", _SAM + "attn.qkv.bias": "bias",  # fused q, k, v, unbound
    _SAM + "attn.proj.weight": "hidden", _SAM + "attn.proj.bias": "bias",
    _SAM + "mlp.lin1.weight": "hidden", _SAM + "mlp.lin1.bias": "bias",
    _SAM + "mlp.lin2.weight": "hidden", _SAM + "mlp.lin2.bias": "bias",
    "vision_encoder.neck.conv1.weight": "hidden",  # a 1×1 convolution of the body
    **_under("vision_encoder.neck.layer_norm1", _LN), **_under("vision_encoder.neck.layer_norm2", _LN),
    "vision_encoder.neck.conv2.weight": "head",  # makes the image embeddings, nothing parameterized after it
}
VIEWS["sam"] = {_SAM + "attn.qkv.weight": "3 × 32×32", _SAM + "attn.proj.weight": "32×32",
                _SAM + "mlp.lin1.weight": "64×32", _SAM + "mlp.lin2.weight": "32×64",
                "vision_encoder.neck.conv1.weight": "16×32"}


def misrouted(plan, roles: dict, views: dict) -> tuple[list[str], list[str]]:
    """The oracle: (wrong-spectral, missed-spectral) tensors of a plan against the hand tables. Wrong:
    the spectral geometry on a tensor that is not a hidden matrix, or on one read as other matrices
    than the forward multiplies by; missed: a hidden matrix without it."""
    wrong, missed = [], []
    for pp in plan:
        want = set(roles[pp.name].split("+"))
        matrix = bool(want & SPECTRAL) and not want & NOT_SPECTRAL
        spectral = pp.geometry["kind"] == "spectral"
        if spectral and (not matrix or describe(pp.geometry.get("view"), pp.op_shape) != views[pp.name]):
            wrong.append(pp.name)
        elif matrix and not spectral:
            missed.append(pp.name)
    return wrong, missed


def test_tables_name_every_hidden_matrix_with_its_view():
    for arch in ARCHS:
        hidden = {n for n, r in ROLES[arch].items() if set(r.split("+")) & SPECTRAL}
        assert set(VIEWS[arch]) == hidden, arch


def assert_traced_roles(model, expected: dict) -> list:
    """The model's tensors are exactly ``expected``'s names, each with its role, every one traced
    (none decided from the module tree alone); returns the tensors' ParamInfos."""
    infos, _ = model_params(model)
    got = {p.name: p.role.name for p in infos}
    assert sorted(set(got) ^ set(expected)) == []
    assert {n: (expected[n], got[n]) for n in expected if got[n] != expected[n]} == {}
    assert {p.role.basis for p in infos} == {"trace"}, {p.role.untraced for p in infos}
    return infos


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_roles_match_the_table(arch):
    assert_traced_roles(build(arch), ROLES[arch])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", SPECTRAL_SPECS)
def test_no_wrong_or_missed_spectral(spec_name, arch):
    plan = compile_spec(ROOT / "specs" / f"{spec_name}.yaml", build(arch))
    assert misrouted(plan, ROLES[arch], VIEWS[arch]) == ([], [])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_shipped_specs_lint_clean(spec_name, arch):
    assert spec_findings(spec_name, build(arch)) == []


def test_the_oracle_sees_a_wrong_view_and_a_missed_matrix():
    """The oracle itself: a lookup table given the spectral geometry, a fused weight read as one
    matrix, and a hidden matrix left to Adam are each counted."""
    plan = list(compile_spec(ROOT / "specs" / "muon.yaml", build("pool")))
    roles = dict(ROLES["pool"], **{"fc.weight": "hidden"})  # as if the head were a matrix of the body
    views = dict(VIEWS["pool"], **{"attn.in_proj_weight": "96×32", "fc.weight": "5×32"})
    assert misrouted(plan, roles, views) == (["attn.in_proj_weight"], ["fc.weight"])
    roles = dict(ROLES["pool"], **{"proj.weight": "embedding"})
    assert misrouted(plan, roles, VIEWS["pool"]) == (["proj.weight"], [])


@pytest.mark.parametrize("arch, name, evidence", [
    ("lstm", "rnn.weight_ih_l0", "unsafe_split of two layers' summed outputs"),  # W_ih·x + W_hh·h, then 4 gates
    ("gru", "rnn.weight_hh_l1", "unsafe_split"),  # each of W_ih·x and W_hh·h cut into r, z, n
    ("transformer", "tr.decoder.layers.0.multihead_attn.in_proj_weight", "split_with_sizes of the weight"),
    ("pool", "attn.in_proj_weight", "split_with_sizes of the weight"),
    ("einsum", "w", "bmm over 3 matrices"),
    ("relpos", "rel_pos", "rows gathered by index, then multiplied"),
    ("relpos-interpolated", "rel_pos", "rows gathered by index, then multiplied"),
    ("tables", "table", "rows picked by the input"),
    ("tables", "latents", "normalized by native_layer_norm"),
    ("pool", "query", "a learned 1×1×32 token, not a matrix"),
])
def test_explain_names_the_op(arch, name, evidence):
    """``explain`` says which op made the view or the lookup."""
    model = build(arch)
    spec = geomopt.load_spec(ROOT / "specs" / "muon.yaml")
    infos, _ = model_params(model)
    text = explain(spec, infos, list(compile_spec(spec, model)), name)
    role_line = next(line for line in text.splitlines() if line.startswith("role"))
    assert evidence in role_line, role_line
    assert "used only elementwise (index)" not in text


def test_explain_lists_the_names_a_prefix_begins():
    """A name that is the start of several parameters lists them, not one picked by spelling."""
    model = build("lstm")
    spec = geomopt.load_spec(ROOT / "specs" / "muon.yaml")
    infos, _ = model_params(model)
    with pytest.raises(KeyError) as err:
        explain(spec, infos, [], "rnn.weight")
    assert ("4 parameter names begin with it: 'rnn.weight_ih_l0', 'rnn.weight_hh_l0', 'rnn.weight_ih_l1', "
            "'rnn.weight_hh_l1'") in str(err.value)
    with pytest.raises(KeyError, match="did you mean 'rnn.weight_ih_l0'"):
        explain(spec, infos, [], "rnn.wieght_ih_l0")


@pytest.mark.parametrize("kind, mode, gates", [("LSTM", 2, 4), ("GRU", 3, 3), ("RNN", 1, 1)])
def test_a_fused_cudnn_kernel_gives_the_gates_of_its_mode(kind, mode, gates):
    """On CUDA ``nn.LSTM`` reaches the dispatcher as one ``_cudnn_rnn`` over its weight list
    (run here on meta tensors through its meta kernel): every weight is a matrix operand, and
    W_ih, W_hh of each layer hold the mode's gates as row blocks."""
    from geomopt.compile.trace.blocks import blocks
    from geomopt.compile.trace.dispatch import Tracer
    from geomopt.compile.trace.ops import Act

    rnn = getattr(nn, kind)(16, 24, num_layers=2, batch_first=True)
    params = [torch.empty(p.shape, device="meta") for p in rnn._flat_weights]
    tracer = Tracer(params, value_free=False)
    x = torch.empty(2, 5, 16, device="meta")
    tracer.acts[x] = Act(frozenset(), True, None)
    hx = torch.zeros(2, 2, 24, device="meta")
    cx = torch.zeros(2, 2, 24, device="meta") if kind == "LSTM" else None
    with tracer:
        out = torch.ops.aten._cudnn_rnn.default(x, params, 4, None, hx, cx, mode, 24, 0, 2, True, 0.0, False, False,
                                                [], None)
    for i, name in enumerate(rnn._flat_weights_names):
        if name.startswith("weight"):
            assert list(tracer.uses[i]) == ["matmul"], name
            assert blocks(tracer.pieces.get(i)) == ([24] * gates if gates > 1 else None), name
        else:
            assert list(tracer.uses[i]) == ["elementwise"], name
    assert tracer.acts.get(out[0]).src == frozenset({0})  # one layer call, whose output flows on


def test_a_fused_cuda_cell_cuts_both_gate_products():
    """``_thnn_fused_lstm_cell`` (CUDA's LSTM cell) takes W_ih·x and W_hh·h whole: each is cut into
    its 4 gates, as the decomposed cell's ``unsafe_chunk`` would."""
    from geomopt.compile.trace.blocks import blocks
    from geomopt.compile.trace.dispatch import Tracer
    from geomopt.compile.trace.ops import Act

    w_ih, w_hh = torch.randn(96, 16), torch.randn(96, 24)
    tracer = Tracer([w_ih, w_hh], value_free=False)
    x, h = torch.randn(2, 16), torch.randn(2, 24)
    for t in (x, h):
        tracer.acts[t] = Act(frozenset(), True, None)
    with tracer:
        gi, gh = x @ w_ih.t(), h @ w_hh.t()
    cell = torch.ops.aten._thnn_fused_lstm_cell.default
    tracer._record(cell, (gi, gh, torch.zeros(2, 24)), {}, (torch.zeros(2, 24), torch.zeros(2, 24), gi))
    assert blocks(tracer.pieces.get(0)) == blocks(tracer.pieces.get(1)) == [24, 24, 24, 24]
    assert list(tracer.view_ops[0]) == ["_thnn_fused_lstm_cell (4 gates)"]


def test_blocks_are_the_finest_partition_of_cuts_that_cover_the_rows():
    from geomopt.compile.trace.blocks import blocks

    assert blocks({(0, 64), (64, 192), (64, 128), (128, 192)}) == [64, 64, 64]  # [q | kv], kv cut again
    assert blocks({(0, 32), (0, 64), (64, 96)}) == [32, 32, 32]
    assert blocks({(0, 64), (128, 192)}) is None  # a gap: rows 64–128 never cut out
    assert blocks({(32, 64), (64, 96)}) is None  # not from row 0
    assert blocks({(0, 64)}) is None  # one block
