"""Fuzzing the routing trace: small models generated from building blocks, each traced as
``GeomOptimizer`` and ``geomopt lint --model`` trace it (:func:`geomopt.compile.compiler.model_params`,
then a plan of the shipped ``muon`` spec).

A model is a stem (an ``nn.Embedding`` reading token ids, or a ``Linear`` reading features), a
``ModuleDict`` of blocks under keys with odd characters, and a ``Linear`` head (tied to the
embedding or not). The blocks: Linear layers with and without bias, LayerNorm and RMSNorm, full
and grouped 1-D and 2-D convolutions, tied Linear layers, parameters used through ``F.linear``,
``@``, ``einsum``, ``bmm``, indexing and ``gather``, reshapes, views, transposes, ``split`` and
``chunk`` before a matmul, residual adds, gating products, buffers, parameters the forward never
uses, a 0-d, a zero-size, a frozen and a complex parameter, weight and spectral norm, BatchNorm,
dropout, in-place ops, activation checkpointing, multi-head and scaled dot-product attention,
LSTM, GRU and a transposed convolution, a weight clamped in place; in float32, float64 or
bfloat16. The forward may raise (always, on the meta device only, in training mode only) or
branch on the data in Python, and returns a tensor, a tuple or a dict.

Properties, for every model:

- the trace and the plan raise nothing but geomopt's own errors (``SpecError`` from the plan), and
  finish within :data:`LIMIT_S` seconds (a hang fails);
- every parameter gets exactly one role (one :class:`Role`, of one kind but for a tied tensor),
  under its own name, tied names as aliases;
- where the construction says the answer, the role is it: a Linear or full convolution whose
  output feeds a later layer is ``hidden``, the embedding ``embedding`` (``embedding+head`` tied),
  the head ``head``, a 1-D norm weight ``norm``, a bias ``bias``, a grouped kernel and a 0-d
  parameter ``other``;
- the model's parameters, buffers, gradients, ``requires_grad`` flags, every module's
  train/eval mode and the RNG state are as they were, bit for bit.

``GEOMOPT_TRACE_FUZZ`` sets how many models are drawn (30 by default, a few seconds); the draws
are derandomized, so every run (CI's included) traces the same models.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import geomopt
from geomopt.compile.compiler import model_params
from geomopt.compile.roles.types import ROLES
from fuzz_pipeline import Hang, model_state, same_state, time_limit

EXAMPLES = int(os.environ.get("GEOMOPT_TRACE_FUZZ", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)
LIMIT_S = 10  # a trace of these models takes well under a second
B, T, VOCAB = 2, 4, 11

#: ModuleDict keys: odd characters, Python words, names of parameters and of wrappers' segments
KEYS = ["a-b", "x y", "\u00fc", "0", "_", "weight", "bias", "\U0001d4b3", "a\u200bb", "class", "tab\t", "module",
        "head", "embed", "norm", "forward_", "lambda", "\u212a", "1e3", "-", "%s", "{}"]


# ---------------------------------------------------------------- blocks: (module, expected roles)


class Block(nn.Module):
    """A block of width ``d`` → ``d``; ``expect`` maps its parameters' local names to the role the
    construction gives them (``traced``: only where the trace decided)."""

    expect: dict[str, str] = {}
    traced: dict[str, str] = {}


class Dense(Block):
    """Linear (with or without bias), an activation; optionally a residual add."""

    def __init__(self, d, bias, residual):
        super().__init__()
        self.lin, self.residual = nn.Linear(d, d, bias=bias), residual
        self.expect = {"lin.weight": "hidden", **({"lin.bias": "bias"} if bias else {})}

    def forward(self, x):
        y = F.gelu(self.lin(x))
        return x + y if self.residual else y


class Mlp(Block):
    """Linear up, activation, Linear down (a transformer MLP)."""

    def __init__(self, d, bias):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d, bias=bias), nn.Linear(2 * d, d, bias=bias)
        self.expect = {"up.weight": "hidden", "down.weight": "hidden",
                       **({"up.bias": "bias", "down.bias": "bias"} if bias else {})}

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Gated(Block):
    """A gating product: a(x) · σ(b(x)); or one fused Linear whose output is chunked into both."""

    def __init__(self, d, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.ab = nn.Linear(d, 2 * d)
            self.expect = {"ab.weight": "hidden", "ab.bias": "bias"}
        else:
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d, bias=False)
            self.expect = {"a.weight": "hidden", "a.bias": "bias", "b.weight": "hidden"}

    def forward(self, x):
        a, b = self.ab(x).chunk(2, dim=-1) if self.fused else (self.a(x), self.b(x))
        return a * torch.sigmoid(b)


class Norm(Block):
    """LayerNorm (weight, bias) or RMSNorm (weight)."""

    def __init__(self, d, kind):
        super().__init__()
        self.norm = nn.LayerNorm(d) if kind == "layer" else nn.RMSNorm(d)
        self.expect = {"norm.weight": "norm", **({"norm.bias": "norm"} if kind == "layer" else {})}

    def forward(self, x):
        return self.norm(x)


class Functional(Block):
    """A bare (d, d) parameter used as a matrix by ``how``: F.linear, ``@`` (on a transpose),
    einsum, bmm on an expanded copy, a view into heads before ``@``, or split halves each
    multiplied by a half of it."""

    def __init__(self, d, how):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(d, d) / d)
        self.expect = {"w": "hidden"}

    def forward(self, x):
        w, how = self.w, self.how
        if how == "linear":
            return F.linear(x, w)
        if how == "matmul":
            return x @ w.t()
        if how == "einsum":
            return torch.einsum("btd,ed->bte", x, w)
        if how == "bmm":
            flat = x.reshape(-1, x.shape[-2], x.shape[-1])
            return torch.bmm(flat, w.expand(flat.shape[0], -1, -1)).view_as(x)
        if how == "view":  # heads: (B, T, d) → (B, T, 2, d/2), each head times W's first block row
            half = x.shape[-1] // 2
            heads = x.view(*x.shape[:-1], 2, half) @ w[:half, :half]
            return heads.reshape(x.shape) + x.transpose(-1, -2).transpose(-1, -2)
        halves = x.split(x.shape[-1] // 2, dim=-1)  # "split"
        return torch.cat([halves[0] @ w[: halves[0].shape[-1]], halves[1] @ w[halves[0].shape[-1]:]], dim=-1)[
            ..., : x.shape[-1]]


class Conv(Block):
    """A 1-D or 2-D convolution over the tokens, full or grouped (``groups`` > 1: a grouped kernel)."""

    def __init__(self, d, dims, groups):
        super().__init__()
        self.dims = dims
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.conv = conv(d, d, 3 if dims == 1 else (3, 1), padding=1 if dims == 1 else (1, 0), groups=groups)
        self.expect = {"conv.weight": "hidden" if groups == 1 else "other", "conv.bias": "bias"}

    def forward(self, x):
        y = x.transpose(1, 2)
        y = self.conv(y) if self.dims == 1 else self.conv(y.unsqueeze(-1)).squeeze(-1)
        return y.transpose(1, 2)


class Tied(Block):
    """Two Linear layers sharing one weight (the second's name an alias of the first's)."""

    def __init__(self, d):
        super().__init__()
        self.one, self.two = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.two.weight = self.one.weight
        self.expect = {"one.weight": "hidden", "one.bias": "bias"}

    def forward(self, x):
        return self.two(torch.tanh(self.one(x)))


class Tables(Block):
    """Tables read by index and by gather, then only elementwise; a buffer; a 0-d scale; a
    parameter the forward never uses (a matrix and a vector)."""

    def __init__(self, d, unused):
        super().__init__()
        self.table = nn.Parameter(torch.randn(T + 3, d))
        self.rows = nn.Parameter(torch.randn(T + 3, d))
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("mask", torch.ones(d))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        if unused:
            self.spare = nn.Parameter(torch.randn(d, d))
            self.spare_vec = nn.Parameter(torch.randn(d))
        self.expect = {"temperature": "other"}
        self.traced = {"table": "other", "rows": "other"}

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        index = pos.view(1, -1, 1).expand(x.shape[0], -1, x.shape[-1])
        gathered = torch.gather(self.rows.unsqueeze(0).expand(x.shape[0], -1, -1), 1, index)
        return (x + self.table[pos] + gathered) * self.mask * self.temperature


class Complex(Block):
    """A complex (d, d) parameter multiplying the activations, the real part kept."""

    def __init__(self, d):
        super().__init__()
        self.c = nn.Parameter(torch.randn(d, d, dtype=torch.complex64) / d)

    def forward(self, x):
        return (x.to(self.c.dtype) @ self.c).real.to(x.dtype)


class Branch(Block):
    """Data-dependent Python control flow: which Linear runs depends on the activations' values
    (the meta device has none, so only a real forward can take it)."""

    def __init__(self, d):
        super().__init__()
        self.pos, self.neg = nn.Linear(d, d), nn.Linear(d, d)
        self.expect = {"pos.weight": "hidden", "neg.weight": "hidden", "pos.bias": "bias", "neg.bias": "bias"}

    def forward(self, x):
        return self.pos(x) if float(x.sum()) >= 0 else self.neg(x)


class Reparametrized(Block):
    """A Linear under weight norm (parametrization: g (d, 1) and v (d, d)) or under the old
    spectral norm (a forward pre-hook writing its ``weight_u`` and ``weight_v`` buffers in training)."""

    def __init__(self, d, how):
        super().__init__()
        lin = nn.Linear(d, d)
        if how == "weight_norm":
            self.lin = nn.utils.parametrizations.weight_norm(lin)
            self.expect = {"lin.bias": "bias"}
        else:
            self.lin = nn.utils.spectral_norm(lin)
            self.expect = {"lin.bias": "bias"}

    def forward(self, x):
        return torch.relu(self.lin(x))


class Stateful(Block):
    """BatchNorm over the features (running statistics in training), dropout (the RNG), an
    in-place op on an activation, a frozen Linear, under activation checkpointing or not."""

    def __init__(self, d, checkpointed):
        super().__init__()
        self.bn, self.drop, self.lin = nn.BatchNorm1d(d), nn.Dropout(0.5), nn.Linear(d, d)
        self.lin.weight.requires_grad_(False)
        self.checkpointed = checkpointed
        self.expect = {"bn.weight": "norm", "bn.bias": "norm", "lin.bias": "bias"}

    def body(self, x):
        y = self.bn(x.transpose(1, 2)).transpose(1, 2)
        y = self.drop(self.lin(y))
        return y.mul_(0.5)

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Lookup(Block):
    """A bare table looked up by ``F.embedding`` (positions), a zero-size matrix multiplied in."""

    def __init__(self, d):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(T + 2, d))
        self.empty = nn.Parameter(torch.empty(0, d))
        self.traced = {"positions": "embedding"}

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        nothing = x @ self.empty.t()  # (B, T, 0)
        return torch.cat([x + F.embedding(pos, self.positions), nothing], dim=-1)


class Attention(Block):
    """``nn.MultiheadAttention`` (its in-projection one fused (3d, d) parameter), or a fused qkv
    Linear chunked into ``F.scaled_dot_product_attention`` over 2 heads, then an output Linear."""

    def __init__(self, d, how):
        super().__init__()
        self.how = how
        if how == "mha":
            self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
            self.expect = {"mha.in_proj_weight": "hidden", "mha.out_proj.weight": "hidden",
                           "mha.in_proj_bias": "bias", "mha.out_proj.bias": "bias"}
        else:
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.expect = {"qkv.weight": "hidden", "proj.weight": "hidden", "qkv.bias": "bias", "proj.bias": "bias"}

    def forward(self, x):
        if self.how == "mha":
            return self.mha(x, x, x, need_weights=False)[0]
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Recurrent(Block):
    """An LSTM or GRU over the tokens (weights ``weight_ih_l0``, ``weight_hh_l0``, biases
    ``bias_ih_l0``, ``bias_hh_l0``), or a transposed 1-D convolution."""

    def __init__(self, d, how):
        super().__init__()
        self.how = how
        if how == "convt":
            self.rnn = nn.ConvTranspose1d(d, d, 3, padding=1)
            self.expect = {"rnn.weight": "hidden", "rnn.bias": "bias"}
        else:
            self.rnn = (nn.LSTM if how == "lstm" else nn.GRU)(d, d, batch_first=True)
            self.expect = {"rnn.weight_ih_l0": "hidden", "rnn.weight_hh_l0": "hidden", "rnn.bias_ih_l0": "bias",
                           "rnn.bias_hh_l0": "bias"}

    def forward(self, x):
        if self.how == "convt":
            return self.rnn(x.transpose(1, 2)).transpose(1, 2)
        return self.rnn(x)[0]


class Clamped(Block):
    """A Linear whose weight the forward clamps in place (a max-norm constraint kept in ``forward``)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.expect = {"lin.weight": "hidden", "lin.bias": "bias"}

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.2, 0.2)
        return self.lin(x)


def blocks(d: int):
    """Strategies of one block of width ``d`` (even)."""
    groups = [g for g in (2, d) if d % g == 0]
    return st.one_of(
        st.builds(Dense, st.just(d), st.booleans(), st.booleans()),
        st.builds(Mlp, st.just(d), st.booleans()),
        st.builds(Gated, st.just(d), st.booleans()),
        st.builds(Norm, st.just(d), st.sampled_from(["layer", "rms"])),
        st.builds(Functional, st.just(d), st.sampled_from(["linear", "matmul", "einsum", "bmm", "view", "split"])),
        st.builds(Conv, st.just(d), st.sampled_from([1, 2]), st.sampled_from([1, *groups])),
        st.builds(Tied, st.just(d)),
        st.builds(Tables, st.just(d), st.booleans()),
        st.builds(Complex, st.just(d)),
        st.builds(Branch, st.just(d)),
        st.builds(Reparametrized, st.just(d), st.sampled_from(["weight_norm", "spectral_norm"])),
        st.builds(Stateful, st.just(d), st.booleans()),
        st.builds(Lookup, st.just(d)),
        st.builds(Attention, st.just(d), st.sampled_from(["mha", "sdpa"])),
        st.builds(Recurrent, st.just(d), st.sampled_from(["lstm", "gru", "convt"])),
        st.builds(Clamped, st.just(d)),
    )


# ---------------------------------------------------------------- the model


class Fuzzed(nn.Module):
    """stem → blocks (a ModuleDict) → head; ``fails``: where the forward raises (``never``,
    ``always``, ``meta``: on the meta device only, ``training``: in training mode only)."""

    def __init__(self, d, stem, layers: dict, tie, fails, returns="tensor"):
        super().__init__()
        self.tokens, self.fails, self.d, self.returns = stem == "embedding", fails, d, returns
        self.stem = nn.Embedding(VOCAB, d) if self.tokens else nn.Linear(3, d)
        self.layers = nn.ModuleDict(layers)
        tie = tie and self.tokens
        self.out = nn.Linear(d, VOCAB, bias=not tie)
        if tie:
            self.out.weight = self.stem.weight

    def inputs(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        if self.tokens:
            return torch.randint(0, VOCAB, (B, T), generator=g)
        return torch.randn(B, T, 3, generator=g).to(self.stem.weight.dtype)

    def forward(self, x):
        h = self.stem(x)
        if self.fails == "always" or (self.fails == "meta" and h.is_meta) or (
                self.fails == "training" and self.training):
            raise RuntimeError(f"this forward refuses ({self.fails})")
        for layer in self.layers.values():
            h = layer(h)
        logits = self.out(h)
        if self.returns == "dict":  # a Hugging Face style output: hidden states are no prediction
            return {"logits": logits, "hidden_states": (h,), "loss": None}
        if self.returns == "tuple":
            return logits, logits.argmax(-1)
        return logits

    def expected(self) -> tuple[dict[str, str], dict[str, str]]:
        """(roles the construction gives, roles a trace gives) by parameter name."""
        tied = self.out.weight is self.stem.weight
        stem = {"stem.weight": "embedding+head" if tied else "embedding"} if self.tokens else {
            "stem.weight": "hidden", "stem.bias": "bias"}
        out = {} if tied else {"out.weight": "head", "out.bias": "bias"}
        expect, traced = {**stem, **out}, {}
        for key, layer in self.layers.items():
            expect.update({f"layers.{key}.{n}": r for n, r in layer.expect.items()})
            traced.update({f"layers.{key}.{n}": r for n, r in layer.traced.items()})
        return expect, traced


@st.composite
def models(draw):
    d = draw(st.sampled_from([4, 6, 8]))
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    torch.manual_seed(draw(st.integers(0, 2 ** 16)))
    layers = {k: draw(blocks(d)) for k in keys}
    model = Fuzzed(d, draw(st.sampled_from(["embedding", "linear"])), layers, draw(st.booleans()),
                   draw(st.sampled_from(["never", "never", "never", "always", "meta", "training"])),
                   draw(st.sampled_from(["tensor", "dict", "tuple"])))
    model.to(draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.bfloat16])))
    model.train(draw(st.booleans()))
    if draw(st.booleans()):
        model.layers[keys[0]].eval()  # modules in mixed modes: each must come back as it was
    return model


# ---------------------------------------------------------------- the properties


def _snapshot(model) -> tuple:
    named = list(model.named_parameters(remove_duplicate=False))
    return (model_state(model), [(n, id(p), p.requires_grad, p.grad) for n, p in named],
            [(n, id(b)) for n, b in model.named_buffers()], torch.get_rng_state().tolist())


def _unique_names(model) -> dict[str, tuple[str, ...]]:
    """First name → its other names, for each distinct parameter."""
    first: dict[int, str] = {}
    out: dict[str, tuple[str, ...]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[first[id(p)]] += (n,)
        else:
            first[id(p)] = n
            out[n] = ()
    return out


@FUZZ
@given(model=models(), own_inputs=st.booleans())
def test_traced_roles_of_generated_models(model, own_inputs):
    if own_inputs:  # the model's own example_inputs() (default_inputs), else example_inputs=
        model.example_inputs = model.inputs
    inputs = None if own_inputs else model.inputs()
    before = _snapshot(model)
    try:
        with time_limit(LIMIT_S), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            infos, _ = model_params(model, example_inputs=inputs)
            try:
                geomopt.compile_spec("muon", model, example_inputs=inputs)
            except geomopt.SpecError as err:  # (a complex matrix under muon's spectral rule)
                event(f"plan refused: {err.diagnostics[0].code}")
    except Hang:
        pytest.fail(f"tracing took more than {LIMIT_S} s")
    after = _snapshot(model)
    assert same_state(before[0], after[0]), "parameters, buffers or modes changed"
    assert before[1:] == after[1:], "parameters, gradients, requires_grad, buffers or the RNG state replaced"

    names = _unique_names(model)
    assert [p.name for p in infos] == list(names)
    for p in infos:
        assert p.aliases == names[p.name], p.name
        r = p.role
        assert r is not None and r.roles and len(set(r.roles)) == len(r.roles) and set(r.roles) <= set(ROLES), p
        assert len(r.roles) == 1 or p.aliases, (p.name, r)  # two roles only for a tensor under two names
    roles = {p.name: p.role.name for p in infos}
    basis = {p.name: p.role.basis for p in infos}
    event(f"trace: {'yes' if 'trace' in basis.values() else 'no'}; fails={model.fails}")
    if "trace" not in basis.values() and model.fails != "always":
        why = infos[0].role.untraced or ""
        event("untraced: " + ("a write to a parameter stopped" if "writes in place" in why else why[:120]))
    expect, traced = model.expected()
    wrong = {n: (roles[n], want, infos[list(names).index(n)].role.evidence) for n, want in expect.items()
             if roles[n] != want}
    wrong.update({n: (roles[n], want, basis[n]) for n, want in traced.items()
                  if basis[n] == "trace" and roles[n] != want})
    assert not wrong, wrong
    if model.fails == "always":
        assert set(basis.values()) == {"module tree"}


def test_the_generator_reaches_every_block_and_failure_mode():
    """The draws cover what the properties are about: each block kind, each failure mode, tied heads."""
    seen: set = set()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(models())
    def collect(model):
        seen.update(type(m).__name__ for m in model.layers.values())
        seen.add(f"fails={model.fails}")
        seen.add(f"tied={model.out.weight is model.stem.weight}")

    collect()
    kinds = {c.__name__ for c in Block.__subclasses__()}
    assert kinds <= seen, kinds - seen
    assert {"fails=never", "fails=always", "fails=meta", "fails=training", "tied=True", "tied=False"} <= seen
