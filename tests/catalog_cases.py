"""The catalogue's comparisons: every spec in specs/catalog/ against an independent
implementation of the optimizer it names, on the same model, the same initial weights and the same
batches. Shared by tests/test_catalog.py (which asserts each case's bound) and benchmarks/catalog.py
(which writes the measured figures to benchmarks/results/catalog.json for the README's table).

A reference is a package (torch.optim, pytorch-optimizer, lion-pytorch) used as it ships, or a
transcription written here from the paper's update rule (float64 master weights where it says so),
or, for two constrained specs, a brute-force computation of the step. The figure compared is, per
parameter tensor, ‖X_geomopt − X_ref‖_F / ‖X_ref − X_0‖_F after ``steps`` optimizer steps (the
difference relative to how far the reference moved the tensor); a case reports the largest over the
model's tensors and asserts it is at most its ``bound`` (0 where the two are bit-identical; the case
says why otherwise).

pytorch-optimizer runs its Newton–Schulz iterations in bf16 (Gram Newton–Schulz in float16) by
default, which on a CPU without bf16 matmuls is ~100× slower and rounds at 4e-3; the cases that use
it swap the module's function for the same function with ``dtype=torch.float32`` (``patches``),
which is the iteration geomopt runs on a CPU (``dtype: auto``). pytorch-optimizer's ``Kron`` draws
its random probes from torch's default generator; ``psgd-kron`` hands it geomopt's probes of the
same step instead (``patches``), so that both fit their factors on the same draws.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "specs" / "catalog"
SHIPPED = ROOT / "specs"
if str(Path(__file__).parent) not in sys.path:  # test_equivalence's Scion transcription, from the script too
    sys.path.insert(0, str(Path(__file__).parent))

import catalog_eo  # noqa: E402
import catalog_mla  # noqa: E402
import catalog_muon_variants  # noqa: E402
import geomopt  # noqa: E402
from geomopt.models import GPT, GPTConfig  # noqa: E402

# ---------------------------------------------------------------- models and batches

GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
LLAMA_CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)


def gpt() -> nn.Module:
    """geomopt's nanoGPT (GPT-2 names; fused q, k, v in ``c_attn``), 1 layer, width 16."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_CFG))


@functools.lru_cache(maxsize=1)
def _llama_template() -> nn.Module:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CFG))
    model.train()
    return model


def llama() -> nn.Module:
    """Hugging Face LlamaForCausalLM from a config, random init: 2 layers, width 32, grouped-query
    attention (k, v 16×32), SwiGLU 64, untied head (96×32). Built once, copied per case."""
    return copy.deepcopy(_llama_template())


def gpt_clip() -> nn.Module:
    """:func:`gpt` with its hidden matrices scaled ×40 (σ₁ ≈ 3–10 ρ), so spectral-ball clipping
    acts on every step, not only on the initial weights."""
    model = gpt()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if _is_gpt_hidden(n, p):
                p.mul_(40.0)
    return model


MODELS = {"gpt": gpt, "gpt-clip": gpt_clip, "llama": llama, "mla-clip": catalog_mla.mla_clip}


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    """The next-token loss on step ``step``'s fixed random batch (the same for every run)."""
    g = torch.Generator().manual_seed(1000 + step)
    if isinstance(model, GPT):
        idx = torch.randint(0, GPT_CFG["vocab_size"], (4, GPT_CFG["block_size"]), generator=g)
        tgt = torch.randint(0, GPT_CFG["vocab_size"], (4, GPT_CFG["block_size"]), generator=g)
        return model(idx, tgt)[1]
    ids = torch.randint(0, LLAMA_CFG["vocab_size"], (4, 16), generator=g)  # 64 tokens: full-rank gradients
    return model(input_ids=ids, labels=ids).loss


def llama_rule(name: str, p: torch.Tensor) -> str:
    """Which rule of the Muon-family specs owns a Llama tensor, by name (independent of geomopt's
    role inference, which the test checks against it)."""
    if name == "model.embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "head"
    return "hidden" if p.ndim == 2 else "rest"


# ---------------------------------------------------------------- references: helpers


class Composite:
    """Several optimizers stepped as one (a Muon for the hidden matrices, an AdamW for the rest);
    ``state`` is their states together."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    @property
    def state(self) -> dict:
        out = {}
        for o in self.opts:
            out.update(o.state)
        return out


def by_rule(model: nn.Module, rule: Callable = llama_rule) -> dict[str, list]:
    groups: dict[str, list] = {"embeddings": [], "head": [], "hidden": [], "rest": []}
    for n, p in model.named_parameters():
        groups[rule(n, p)].append(p)
    return groups


def adamw_rest(groups: dict, *, lr=1e-3, wd=0.1, betas=(0.9, 0.95), eps=1e-8, decayed=("embeddings", "head")):
    """torch.optim.AdamW(fused=True) on the embeddings and head (decay ``wd``) and the rest (none):
    the Muon-family specs' AdamW rules."""
    return torch.optim.AdamW([dict(params=groups[k], weight_decay=wd if k in decayed else 0.0)
                              for k in ("embeddings", "head", "rest") if groups[k]],
                             lr=lr, betas=betas, eps=eps, fused=True)


def use_muon_groups(groups: dict, muon: dict, *, lr=1e-3, wd=0.1, betas=(0.9, 0.95), eps=1e-8) -> list[dict]:
    """pytorch-optimizer's Muon-family param groups: the hidden matrices with ``use_muon=True``,
    AdamW groups for the rest (eps and betas given, not the package's defaults)."""
    out = [dict(params=groups["hidden"], use_muon=True, **muon)]
    for k in ("embeddings", "head", "rest"):
        out.append(dict(params=groups[k], use_muon=False, lr=lr, betas=betas, eps=eps,
                        weight_decay=wd if k != "rest" else 0.0))
    return out


NS_COEFFS = (3.4445, -4.7750, 2.0315)


# ---------------------------------------------------------------- transcriptions


class NormalizedSGDM:
    """Cutkosky & Mehta 2020 (ICML, arXiv:2002.03305), Algorithm 1 "Normalized SGD with Momentum",
    in float64, on each tensor:

        m_t = β·m_{t−1} + (1 − β)·∇f(x_t, ξ_t)
        x_{t+1} = x_t − η·m_t/‖m_t‖

    with m_0 = 0 (the authors' code, google-research/nigt_optimizer, initializes m to zeros and
    normalizes per variable)."""

    def __init__(self, model: nn.Module, *, lr: float, beta: float):
        self.lr, self.beta = lr, beta
        self.params = list(model.parameters())
        self.x = [p.detach().double().clone() for p in self.params]
        self.state = {p: {"m": torch.zeros_like(x)} for p, x in zip(self.params, self.x)}

    @torch.no_grad()
    def step(self):
        for p, x in zip(self.params, self.x):
            m = self.state[p]["m"]
            m.copy_(self.beta * m + (1 - self.beta) * p.grad.double())
            x.sub_(self.lr * m / m.norm())
            p.copy_(x)


class DionF64:
    """Dion (Ahn, Xu, Abreu & Langford 2025, "Dion: Distributed Orthonormalized Updates",
    arXiv:2504.05295), Algorithm 1 in its single-device form as microsoft/dion's
    dion/dion_simple.py states it, written here in float64 on each matrix X (m×n) with momentum M
    (M⁰ = 0) and right factor Q (n×r, Q⁰ a standard Gaussian):

        M ← M + G;  P = QR(M·Q).Q;  R = Mᵀ·P
        M ← M − (1 − μ)·P·Rᵀ                       (error feedback)
        Q ← R / (‖R_{:,j}‖ + ε)                    (column normalization)
        X ← X(1 − η·λ) − η·√(m/n)·P·Qᵀ

    r = ⌈rank·min(m, n)⌉ for a fractional rank. Q⁰ is drawn from a CPU generator seeded 0 (the
    seed geomopt's ``dion`` direction uses, so the two start from the same Q⁰; the algorithm
    leaves Q⁰ to the caller)."""

    def __init__(self, params, *, lr: float, mu: float, weight_decay: float, rank: float, eps: float = 1e-8):
        self.lr, self.mu, self.wd, self.eps = lr, mu, weight_decay, eps
        self.params = list(params)
        self.x = [p.detach().double().clone() for p in self.params]
        self.state = {}
        for p in self.params:
            m, n = p.shape
            r = rank if isinstance(rank, int) else math.ceil(rank * min(m, n))
            q = torch.randn(n, r, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            self.state[p] = {"momentum": torch.zeros(m, n, dtype=torch.float64), "Q": q}

    @torch.no_grad()
    def step(self):
        for p, x in zip(self.params, self.x):
            st = self.state[p]
            mom = st["momentum"] + p.grad.double()
            pf, _ = torch.linalg.qr(mom @ st["Q"])
            r = mom.T @ pf
            st["momentum"] = mom - (1 - self.mu) * (pf @ r.T)
            st["Q"] = r / (r.norm(dim=0, keepdim=True) + self.eps)
            m, n = x.shape
            x.mul_(1 - self.lr * self.wd).sub_(math.sqrt(m / n) * self.lr * (pf @ st["Q"].T))
            p.copy_(x)


def zeropower_torch(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton–Schulz (bf16, X/max(‖X‖_F, 1e-7), five quintic steps):
    torch.optim._muon's helper where it exists, else the same steps written out."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError:  # pragma: no cover - torch without Muon
        a, b, c = NS_COEFFS
        x = g.bfloat16()
        tall = g.size(0) > g.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x
    return _zeropower_via_newtonschulz(g, NS_COEFFS, 5, 1e-7)


class MuonCautiousWD:
    """Muon with cautious weight decay (Chen et al. 2025, arXiv:2510.12402), transcribed: torch.optim.Muon's
    momentum (buf ← lerp(buf, g, 1 − μ), Nesterov u = lerp(g, buf, μ)) and Newton–Schulz
    (:func:`zeropower_torch`), U scaled by √max(1, A/B) ("original"), then the paper's update

        W ← W − lr·(U + λ·[U⊙W ≥ 0]⊙W)."""

    def __init__(self, params, *, lr: float, momentum: float, weight_decay: float):
        self.params, self.lr, self.mu, self.wd = list(params), lr, momentum, weight_decay
        self.state = {p: {"momentum_buffer": torch.zeros_like(p)} for p in self.params}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            buf = self.state[p]["momentum_buffer"]
            buf.lerp_(p.grad, 1 - self.mu)
            u = zeropower_torch(p.grad.lerp(buf, self.mu)).to(p.dtype)
            u = u * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
            mask = (u * p >= 0).to(p.dtype)
            p.sub_(self.lr * (u + self.wd * mask * p))


class PolarGradM:
    """PolarGrad with momentum (Lau, Long & Su 2025, arXiv:2505.21799), transcribed in float64:
    M ← βM + (1 − β)G; U, S, Vᵀ = svd(M); W ← W − lr·ΣS·U·Vᵀ (the polar factor of M scaled by its
    nuclear norm tr(H), M = U_p·H)."""

    def __init__(self, params, *, lr: float, beta: float):
        self.params, self.lr, self.beta = list(params), lr, beta
        self.w = [p.detach().double().clone() for p in self.params]
        self.state = {p: {"M": torch.zeros_like(w)} for p, w in zip(self.params, self.w)}

    @torch.no_grad()
    def step(self):
        for p, w in zip(self.params, self.w):
            m = self.state[p]["M"]
            m.copy_(self.beta * m + (1 - self.beta) * p.grad.double())
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            w.sub_(self.lr * s.sum() * (u @ vh))
            p.copy_(w)


def _gpt_hidden_blocks(name: str, p: torch.Tensor) -> list[torch.Tensor]:
    """The matrices a GPT hidden weight holds under ``view: auto``: q, k, v of the fused c_attn,
    else the weight itself (views into ``p``)."""
    return list(p.chunk(3, dim=0)) if name.endswith("attn.c_attn.weight") else [p]


def _is_gpt_hidden(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith("transformer.h.")


class ScionThenSet:
    """uScion's step (test_equivalence.ScionReference: Scion's update rules written from their
    definitions) followed by ``project`` on every hidden matrix (each q, k, v block of c_attn its
    own), in float64; ``init`` is applied to them when the reference is built (geomopt's
    ``project_on_init``)."""

    def __init__(self, model: nn.Module, project: Callable, init: Callable, *, lr: float):
        from test_equivalence import ScionReference

        self.scion = ScionReference(model, lr=lr, alpha=0.1, constrained=False, eps_per_unit=True)
        self.lr, self.project = lr, project
        self.active = 0  # matrices the step moved by more than rounding (the set was active)
        self.hidden = [(n, p) for n, p in model.named_parameters() if _is_gpt_hidden(n, p)]
        self.state = {p: {"momentum": buf} for _, p, _, _, buf in self.scion.items}
        with torch.no_grad():
            for n, p in self.hidden:
                for blk in _gpt_hidden_blocks(n, p):
                    blk.copy_(init(blk.double(), _rho(blk)))

    @torch.no_grad()
    def step(self):
        self.scion.step()
        for n, p in self.hidden:
            for blk in _gpt_hidden_blocks(n, p):
                rho = _rho(blk)
                y = blk.double()
                x = self.project(y, rho, self.lr * rho)
                self.active += int(float((x - y).norm()) > 1e-6 * float(y.norm()))
                blk.copy_(x)


def _rho(m: torch.Tensor) -> float:
    """The spectral lmo radius of a matrix under ``scale: scion``: √(dout/din)."""
    return math.sqrt(m.shape[0] / m.shape[1])


def clip_spectrum(y: torch.Tensor, r: float, t: float = 0.0) -> torch.Tensor:
    """Projection onto the spectral ball of radius r: U·min(Σ, r)·Vᵀ (float64 SVD)."""
    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    return (u * s.clamp(max=r)) @ vh


def _h_pow4(u, eps: float):
    """The κ = 4 power barrier h(u) = ε(u²/2)·₂F₁(1/2, 1/4; 3/2; u⁴) and h'(u) = εu/(1 − u⁴)^{1/4},
    written from its definition (geomopt.spec.geometries.PowerBarrier)."""
    import numpy as np
    import scipy.special as sp

    a = np.abs(u)
    h = eps * a * a / 2 * sp.hyp2f1(0.5, 0.25, 1.5, np.minimum(a, 1) ** 4)
    dh = eps * u / np.maximum(1 - a**4, 1e-300) ** 0.25
    return np.where(a < 1, h, np.inf), dh


def sphere_prox(y: torch.Tensor, r: float, t: float, eps: float = 0.002) -> torch.Tensor:
    """The proximal step of the Frobenius sphere ‖X‖_F = r in the spectral κ = 4 power-barrier
    geometry, by brute force: both the objective t·Σh(σ(X − Y)/t) and the set are unitarily
    invariant, so X shares Y's singular vectors (von Neumann) and its singular values x solve
    min Σh((x − σ)/t) s.t. ‖x‖ = r, |x − σ| < t, here by scipy's SLSQP in float64 from the
    Euclidean projection σ·r/‖σ‖."""
    import numpy as np
    import scipy.optimize as so

    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    sig = s.numpy()

    def f(x):
        h, dh = _h_pow4((x - sig) / t, eps)
        return float(h.sum()) / eps, dh / (t * eps)

    x0 = sig * (r / np.linalg.norm(sig))
    res = so.minimize(f, x0, jac=True, method="SLSQP",
                      constraints=[{"type": "eq", "fun": lambda x: x @ x - r * r, "jac": lambda x: 2 * x}],
                      bounds=[(v - t * (1 - 1e-12), v + t * (1 - 1e-12)) for v in sig],
                      options={"ftol": 1e-16, "maxiter": 500})
    x = torch.from_numpy(res.x * (r / np.linalg.norm(res.x)))  # on the sphere to the last bit
    return (u * x) @ vh


def fro_sphere_init(x: torch.Tensor, r: float) -> torch.Tensor:
    return x * (r / x.norm())


# ---------------------------------------------------------------- the cases


def _pin_ns_dtype(dtype: str) -> Callable[[dict], dict]:
    """A spec edit: the hidden rule's Newton–Schulz dtype pinned (torch.optim.Muon is bf16 always)."""

    def edit(spec: dict) -> dict:
        for rule in spec["rules"]:
            if rule["name"] == "hidden":
                rule["geometry"]["approx"]["dtype"] = dtype
        return spec

    return edit


def _fp32(module: str, attr: str) -> tuple[str, str, Callable]:
    return module, attr, lambda original: functools.partial(original, dtype=torch.float32)


_PO = "pytorch_optimizer.optimizer"
NS_FP32 = (_fp32(f"{_PO}.muon.base", "zero_power_via_newton_schulz_5"),
           _fp32(f"{_PO}.muon.normuon", "zero_power_via_newton_schulz_5"),
           _fp32(f"{_PO}.muon.adamuon", "zero_power_via_newton_schulz_5"))


#: the two ways a case is run (``run(case, mode)``)
MODES = ("same", "loss")


@dataclasses.dataclass(frozen=True)
class Case:
    """One catalogue entry and how it is compared. Each case runs in two modes: ``same`` gives both
    optimizers the same standard-normal gradients every step (the optimizers' arithmetic alone),
    ``loss`` lets each model take the gradient of its own next-token loss on the step's fixed batch
    (the two training trajectories; differences feed back through the gradients)."""

    key: str  # the spec's file name in specs/catalog/, without .yaml
    optimizer: str
    paper: str
    url: Optional[str]  # arXiv (or the authors') URL; None where there is no paper to link
    reference: str  # what the spec is compared with
    kind: str  # "package", "transcription" or "brute force"
    model: str  # a key of MODELS
    build: Callable[[nn.Module], object]  # reference model → an optimizer-like object (step(), state)
    bound: float  # the largest relative difference allowed on the same gradients
    why: str  # why that bound (0: bit for bit)
    loss_bound: float = 0.0  # … on the LM loss
    loss_why: str = ""
    rule: Optional[Callable[[str, torch.Tensor], str]] = None  # the rule expected per tensor (None: "all")
    steps: int = 6
    spec_edit: Optional[Callable[[dict], dict]] = None
    patches: tuple = ()  # (module, attribute, original → replacement)
    same_as: Optional[str] = None  # the shipped spec (specs/) this one must equal
    logits: bool = False  # QK-clip: an attention monitor on geomopt's model, and a forward in ``same`` mode too

    @property
    def path(self) -> Path:
        return CATALOG / f"{self.key}.yaml"


def _sgd(nesterov: bool):
    return lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=nesterov)


def _sign_sgd(momentum: float):
    def build(m):
        from pytorch_optimizer import SignSGD

        return SignSGD(m.parameters(), lr=1e-3, momentum=momentum, weight_decay=0.0)

    return build


def _lion(m):
    from lion_pytorch import Lion

    return Lion(m.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=1.0)


def _cautious_lion(m):
    from pytorch_optimizer import Lion

    return Lion(m.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=1.0, cautious=True)


def _tiger(m):
    from pytorch_optimizer import Tiger

    return Tiger(m.parameters(), lr=1e-3, beta=0.965, weight_decay=0.01)


def _lars(m):
    from pytorch_optimizer import LARS

    return LARS(m.parameters(), lr=1.0, momentum=0.0, weight_decay=5e-4, trust_coefficient=1e-3)


def lars_rule(name: str, p: torch.Tensor) -> str:
    """LARS's split: pytorch-optimizer's LARS scales tensors of more than one dimension."""
    return "layers" if p.ndim > 1 else "vectors"


def _lamb(m):
    from pytorch_optimizer import Lamb

    return Lamb(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0, weight_decouple=False,
                adam_debias=True, max_grad_norm=0.0)


def _torch_muon(m):
    g = by_rule(m)
    muon = torch.optim.Muon(g["hidden"], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="original")
    return Composite(muon, adamw_rest(g))


def _muon_cwd(m):
    g = by_rule(m)
    return Composite(MuonCautiousWD(g["hidden"], lr=0.02, momentum=0.95, weight_decay=0.1), adamw_rest(g))


def _gram_muon(m):
    from pytorch_optimizer import Muon

    muon = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, use_adjusted_lr=False)
    return Muon(use_muon_groups(by_rule(m), muon), ns_method="gram_newton_schulz", ns_reset_steps=(2,))


def mla_rule(name: str, p: torch.Tensor) -> str:
    """:func:`llama_rule` for the MLA model, with its per-head query/key projections in ``qk``."""
    return "qk" if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")) else llama_rule(name, p)


def _muonclip(m):
    """pytorch-optimizer's MuonClip as Kimi K2 sets it (τ = 100, α = 0.5, μ = 0.95, Moonlight's
    0.2·√max(m, n), wd 0.1), on whole matrices; its clip on the MLA per-head parts
    (tests/catalog_mla.py)."""
    g = by_rule(m, lambda n, p: "hidden" if mla_rule(n, p) == "qk" else mla_rule(n, p))
    muon = dict(lr=2e-4, momentum=0.95, weight_decay=0.1, use_adjusted_lr=True)
    return catalog_mla.MuonClipMLA(m, use_muon_groups(g, muon, lr=2e-4), qk_clip_threshold=100.0, qk_clip_alpha=0.5)


def _moonlight(m):
    g = by_rule(m)
    muon = torch.optim.Muon(g["hidden"], lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    return Composite(muon, adamw_rest(g))


#: Polar Express, Algorithm 1 of arXiv:2505.16932 (Amsel et al. 2025): the degree-5 coefficients as
#: printed (minimax for σ ∈ [1e-3, 1]), and the safety factor applied as the algorithm does,
#: p(x/1.01): (a/1.01, b/1.01³, c/1.01⁵). pytorch-optimizer's own "polar_express" preset is another
#: run of the recipe (safety 1e-2 in its construction), so the case passes this list.
_PE_PRINTED = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
               (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
               (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
               (3.3184196573706015, -2.488488024314874, 0.51004894012372),
               (2.300652019954817, -1.6689039845747493, 0.4188073119525673))
PE_ALG1 = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_PRINTED]


def _polar_express_muon(m):
    from pytorch_optimizer import Muon

    muon = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, use_adjusted_lr=False)
    return Muon(use_muon_groups(by_rule(m), muon), ns_coeffs=PE_ALG1)


def _namo(m):
    g = by_rule(m)
    namo = catalog_eo.Namo(g["hidden"], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                           coefficients=catalog_eo.SIMPLE, scale=catalog_eo.shape_scaling, beta2=0.95, eps=1e-8)
    return Composite(namo, adamw_rest(g))


def _muon_hyperball(m):
    g = by_rule(m)
    hb = catalog_eo.MuonHyperball(g["hidden"], radius=1.0, lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=True,
                                  coefficients=catalog_eo.SIMPLE, scale=lambda a, b: max(a, b) ** 0.5)
    return Composite(hb, adamw_rest(g))


def _spel(m):
    g = by_rule(m)
    spel = catalog_eo.Spel(g["hidden"], lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=False,
                           coefficients=catalog_eo.QUINTIC)
    return Composite(spel, adamw_rest(g))


def _polargrad_ns(m):
    g = by_rule(m)
    pg = catalog_eo.PolarGrad(g["hidden"], lr=1e-3, momentum=0.9, weight_decay=0.0, nesterov=False,
                              coefficients=catalog_eo.QUINTIC)
    return Composite(pg, adamw_rest(g, wd=0.0))


def _muon_cans(m):
    g = by_rule(m)
    muon = catalog_eo.OrthogonalizedOptimizer(g["hidden"], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                                              coefficients=catalog_eo.CANS, scale=catalog_eo.shape_scaling)
    return Composite(muon, adamw_rest(g))


def _turbo_muon(m):
    g = by_rule(m)
    muon = catalog_eo.TurboMuon(g["hidden"], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                                coefficients=catalog_eo.AOL, scale=catalog_eo.shape_scaling)
    return Composite(muon, adamw_rest(g))


def _muon_plus(m):
    g = by_rule(m)
    return Composite(catalog_muon_variants.MuonPlus(g["hidden"], lr=0.02, weight_decay=0.1, norm_mode="row_col"),
                     adamw_rest(g))


def _normuon_hyperball(m):
    g = by_rule(m)
    return Composite(catalog_muon_variants.NorMuonH(g["hidden"], lr=0.02, radius=1.0), adamw_rest(g))


def _contra_muon(m):
    g = by_rule(m)
    return Composite(catalog_muon_variants.ContraMuon(g["hidden"], lr=0.02, contra=0.4), adamw_rest(g))


def _normuon(update_scale: str):
    def build(m):
        from pytorch_optimizer import NorMuon

        muon = dict(lr=0.02, momentum=0.95, nesterov=True, beta2=0.95, weight_decay=0.1, eps=1e-10,
                    update_scale=update_scale, use_adjusted_lr=False)
        return NorMuon(use_muon_groups(by_rule(m), muon))

    return build


def _adamuon(m):
    from pytorch_optimizer import AdaMuon

    muon = dict(lr=0.02, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-10, use_adjusted_lr=True)
    return AdaMuon(use_muon_groups(by_rule(m), muon))


class Reported:
    """An optimizer whose state is counted as :func:`state_elements` reads a state: the tensors of a
    list entry one by one (pytorch-optimizer's SOAP keeps its factors and bases as lists), and
    without ``unread``: buffers it keeps but, as configured, never reads (its Shampoo allocates a
    momentum buffer at momentum 0)."""

    def __init__(self, opt, *unread: str):
        self.opt, self.unread = opt, unread

    def step(self):
        self.opt.step()

    @property
    def state(self) -> dict:
        out: dict = {}
        for p, st in self.opt.state.items():
            entry = out[p] = {}
            for k, v in st.items():
                if k in self.unread:
                    continue
                items = enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]
                entry.update({k if i is None else f"{k}.{i}": t for i, t in items})
        return out


class ShampooState(Reported):
    """ScalableShampoo's state as :func:`state_elements` reads it: the factors, their roots and the
    graft's statistics, which it keeps in objects (its momenta, the update's and the graft's, are not
    read at β₁ = 0 with preconditioning from the first step)."""

    @property
    def state(self) -> dict:
        out: dict = {}
        for p, st in self.opt.state.items():
            pre = st["pre_conditioner"]
            tensors = [*pre.statistics, *pre.pre_conditioners, st["graft"].statistics]
            out[p] = {f"t{i}": t for i, t in enumerate(tensors)}
        return out


def _shampoo(m):
    from pytorch_optimizer import Shampoo

    g = by_rule(m)
    peer = Shampoo(g["hidden"], lr=0.02, momentum=0.0, matrix_eps=1e-3, preconditioning_compute_steps=1)
    return Composite(Reported(peer, "momentum_buffer"), adamw_rest(g))


def kron_step_probes(every: int = 1) -> Callable:
    """A patch of pytorch-optimizer's ``Kron``: its probes (``torch.randn_like`` from the default
    generator) replaced by geomopt's for the same step (:func:`geomopt.geometry.kron_psgd.probe`, seeded
    with the step), the step counted per parameter as its fits times ``every``."""
    from geomopt.geometry import kron_psgd

    def make(original):
        fits: dict = {}

        def update(qs, expressions, v, g, step, eps):
            n = fits[id(qs)] = fits.get(id(qs), 0) + 1
            return original(qs, expressions, kron_psgd.probe(v, n * every).clone(), g, step, eps)

        return update

    return make


#: Kron's probes, geomopt's (each run draws from its own generator: Kron from torch's default one)
PSGD_PROBES = ((f"{_PO}.psgd", "update_precondition", kron_step_probes()),)


def _scalable_shampoo(m):
    from pytorch_optimizer import ScalableShampoo
    from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

    g = by_rule(m)
    peer = ScalableShampoo(g["hidden"], lr=0.02, betas=(0.0, 0.99), matrix_eps=1e-6, diagonal_eps=1e-8,
                           start_preconditioning_step=1, preconditioning_compute_steps=4, block_size=64,
                           shape_interpretation=False, nesterov=False, use_svd=True,
                           graft_type=LayerWiseGrafting.ADAGRAD)
    return Composite(ShampooState(peer), adamw_rest(g))


def soap_rule(name: str, p: torch.Tensor) -> str:
    """soap's rules: k_proj, v_proj (16 × 32); the other hidden matrices (the Muon specs' rules)."""
    return "kv" if name.endswith(("k_proj.weight", "v_proj.weight")) else llama_rule(name, p)


def _soap(m):
    from pytorch_optimizer import SOAP

    g = by_rule(m)
    sides = {"kv": 16, "hidden": 32}  # a rectangular matrix: its short side only (q_proj, o_proj: both)
    groups = [dict(params=[p for n, p in m.named_parameters() if soap_rule(n, p) == k], max_precondition_dim=d)
              for k, d in sides.items()]
    soap = SOAP(groups, lr=0.003, betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8, precondition_frequency=2,
                weight_decay=0.0)
    return Composite(Reported(soap), adamw_rest(g))


def _psgd_kron(m):
    from pytorch_optimizer import Kron

    g = by_rule(m)
    peer = Kron(g["hidden"], lr=0.003, momentum=0.9, pre_conditioner_update_probability=1.0, balance_prob=1.0)
    return Composite(Reported(peer, "expressions"), adamw_rest(g))


def soap_muon_rule(name: str, p: torch.Tensor) -> str:
    """soap-muon's rules: SOAP on the square attention projections, else the Muon specs' (by name)."""
    return "attention" if name.endswith(("q_proj.weight", "o_proj.weight")) else llama_rule(name, p)


def _soap_muon(m):
    from pytorch_optimizer import SOAP

    g = by_rule(m, lambda n, p: "hidden" if soap_muon_rule(n, p) == "hidden" else llama_rule(n, p))
    soap = SOAP([p for n, p in m.named_parameters() if soap_muon_rule(n, p) == "attention"], lr=0.003,
                betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8, precondition_frequency=2, weight_decay=0.0)
    g["hidden"] = [p for n, p in m.named_parameters() if soap_muon_rule(n, p) == "hidden"]
    muon = torch.optim.Muon(g["hidden"], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="original")
    return Composite(Reported(soap), muon, adamw_rest(g))


def _polargrad(m):
    g = by_rule(m)
    return Composite(PolarGradM(g["hidden"], lr=1e-3, beta=0.9), adamw_rest(g, wd=0.0))


def _dion(m):
    g = by_rule(m)
    return Composite(DionF64(g["hidden"], lr=0.02, mu=0.95, weight_decay=0.1, rank=0.25), adamw_rest(g))


def _scion(constrained: bool):
    def build(m):
        from test_equivalence import ScionReference

        ref = ScionReference(m, lr=0.02, alpha=0.1, constrained=constrained, eps_per_unit=True)
        ref.state = {p: {"momentum": buf} for _, p, _, _, buf in ref.items}
        return ref

    return build


def gpt_scion_rule(name: str, p: torch.Tensor) -> str:
    """Which rule of the Scion-family specs owns a GPT tensor, by name."""
    if name.startswith("transformer.wte") or name.startswith("transformer.wpe"):
        return "embeddings"
    if name == "lm_head.weight":
        return "head"
    return "hidden" if _is_gpt_hidden(name, p) else "rest"


_BIT = "bit for bit: the same operations in the same order"
_F64 = ("the transcription keeps float64 weights, geomopt float32 ones: its rounding of X relative to the move, "
        "u·‖X‖/‖X − X₀‖, is ~1e-6 on LayerNorm gains near 1")
_NS32 = ("both run Newton–Schulz in float32, in different op orders (pytorch-optimizer: addmm into buffers; "
         "geomopt: its batched form), and pytorch-optimizer's AdamW groups use lerp where geomopt calls torch's "
         "fused kernel: fp32 rounding")
_GRAM = ("the Gram iteration works with XXᵀ, which squares the condition number: two float32 Gram Newton–Schulz "
         "implementations in different op orders round about 10× more apart than plain Newton–Schulz")
_SCION = ("Newton–Schulz in float32 in different op orders; Scion's ColNorm/BiasRMS ε read per unit, as the "
          "specs write it (ε = 1e-8 fixed; Scion's own 1e-8/c differs by up to 3e-4 on tiny gradients, "
          "tests/test_equivalence.py)")
_EO32 = ("both run Newton–Schulz in float32 in different op orders (the transcription: Emerging-Optimizers' addmm "
         "steps; geomopt: its batched form), and decoupled decay as p + (−λγ)p there, X(1 − γλ) here: fp32 rounding")
_VAR32 = ("both run Newton–Schulz in float32 in different op orders (the transcription: the authors' "
          "X ← aX + (bA + cA²)X; geomopt: its batched form): fp32 rounding")
_F64_DION = ("geomopt runs the power iteration, its QR and the error feedback in float32, the transcription in "
             "float64: float32 rounding")
LAMB_WHY = ("the package divides m by √v + ε without Adam's bias corrections, geomopt by √v̂ + ε with them; the "
            "ratio divides the scale out, ε = 1e-12 (≪ √v) leaves the rest to float32 rounding, and the adam "
            "geometry's moments are lerps where the package multiplies and adds. On Llama, whose tensors are all "
            "nonzero: a zero tensor (a bias at initialization) takes the ratio 1 on its first step, where the "
            "missing bias corrections show (×√(1 − β₂)/(1 − β₁) ≈ 0.32)")
_LOSS = ("on the loss, the float32 differences of one step change the next step's gradients; Adam's "
         "normalization of the small gradients of norm gains amplifies them most")

CASES: list[Case] = [
    Case("sgd-momentum", "SGD with momentum", "Polyak 1964; Sutskever et al. 2013",
         "https://proceedings.mlr.press/v28/sutskever13.html", "`torch.optim.SGD(momentum=0.9)`", "package", "gpt",
         _sgd(False), 0.0, _BIT + " (heavy_ball is torch's single-tensor loop)", 0.0),
    Case("sgd-nesterov", "SGD with Nesterov momentum", "Sutskever et al. 2013",
         "https://proceedings.mlr.press/v28/sutskever13.html", "`torch.optim.SGD(momentum=0.9, nesterov=True)`",
         "package", "gpt", _sgd(True), 0.0, _BIT, 0.0),
    Case("adam", "Adam", "Kingma & Ba 2015", "https://arxiv.org/abs/1412.6980", "`torch.optim.Adam(fused=True)`",
         "package", "gpt", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                      fused=True),
         0.0, _BIT + " (the adam geometry calls torch's fused kernel)", 0.0),
    Case("adamw", "AdamW", "Loshchilov & Hutter 2019", "https://arxiv.org/abs/1711.05101",
         "`torch.optim.AdamW(weight_decay=0.01, fused=True)`", "package", "gpt",
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                     fused=True),
         0.0, _BIT, 0.0),
    Case("signsgd", "signSGD", "Bernstein et al. 2018", "https://arxiv.org/abs/1802.04434",
         "`pytorch_optimizer.SignSGD(momentum=0)`", "package", "gpt", _sign_sgd(0.0), 0.0, _BIT, 0.0),
    Case("signum", "Signum", "Bernstein et al. 2018", "https://arxiv.org/abs/1802.04434",
         "`pytorch_optimizer.SignSGD(momentum=0.9)`", "package", "gpt", _sign_sgd(0.9), 0.0,
         _BIT + " (its momentum is buf.lerp_(g, 1 − β), Polyak's)", 0.0),
    Case("lion", "Lion", "Chen et al. 2023", "https://arxiv.org/abs/2302.06675",
         "`lion_pytorch.Lion(weight_decay=1.0)`", "package", "gpt", _lion, 0.0, _BIT, 0.0),
    Case("lion-cautious", "Cautious Lion (C-Lion)", "Liang et al. 2024", "https://arxiv.org/abs/2411.16085",
         "`pytorch_optimizer.Lion(weight_decay=1.0, cautious=True)`", "package", "gpt", _cautious_lion, 0.0, _BIT, 0.0),
    Case("tiger", "Tiger", "Su 2023", "https://github.com/bojone/tiger", "`pytorch_optimizer.Tiger(beta=0.965)`",
         "package", "gpt", _tiger, 0.0, _BIT + " (its momentum is exp_avg.lerp_(g, 1 − β), Polyak's)", 0.0),
    Case("lars", "LARS (without momentum)", "You, Gitman & Ginsburg 2017", "https://arxiv.org/abs/1708.03888",
         "`pytorch_optimizer.LARS(momentum=0, weight_decay=5e-4, trust_coefficient=1e-3)`", "package", "gpt", _lars,
         0.0, _BIT + " (the ratio's norms, G + λX and its scaling in the package's order)", 0.0, rule=lars_rule),
    Case("lamb", "LAMB", "You et al. 2020", "https://arxiv.org/abs/1904.00962",
         "`pytorch_optimizer.Lamb(eps=1e-12, weight_decouple=False, adam_debias=True, max_grad_norm=0)`", "package",
         "llama", _lamb, 3e-6, LAMB_WHY, 1e-5, _LOSS),
    Case("normalized-sgd-momentum", "Normalized SGD with momentum", "Cutkosky & Mehta 2020",
         "https://arxiv.org/abs/2002.03305", "Algorithm 1 in float64, per tensor", "transcription",
         "gpt", lambda m: NormalizedSGDM(m, lr=0.01, beta=0.9), 2e-5, _F64, 3e-5, _F64),
    Case("muon", "Muon", "Jordan et al. 2024; Liu et al. 2025", "https://arxiv.org/abs/2502.16982",
         "`torch.optim.Muon` + `torch.optim.AdamW(fused=True)`", "package", "llama", _torch_muon, 0.0,
         _BIT + ": both run Newton–Schulz in bf16 (the test pins the spec's dtype: torch's Muon is bf16 always)",
         0.0, rule=llama_rule, spec_edit=_pin_ns_dtype("bfloat16"), same_as="muon"),
    Case("muon-cautious-wd", "Muon + cautious weight decay", "Chen et al. 2025", "https://arxiv.org/abs/2510.12402",
         "torch.optim.Muon's algorithm and bf16 Newton–Schulz, then the paper's decay; `torch.optim.AdamW(fused=True)`",
         "transcription", "llama", _muon_cwd, 1e-6,
         "bf16 Newton–Schulz on both sides (pinned); the transcription writes W − lr·(U + λ·mask⊙W), geomopt "
         "W(1 − lr·λ) − lr·U where the mask holds: fp32 rounding",
         0.2, "bf16 Newton–Schulz turns fp32-rounding differences of the weights (through the next gradients) "
               "into bf16-rounding differences of the update, 4e-3 relative: trajectories drift apart at that "
               "rate, as two bf16 Muons that round differently would (tests/test_catalog.py checks only that they stay "
               "within 0.2)",
         rule=llama_rule, spec_edit=_pin_ns_dtype("bfloat16")),
    Case("normuon", "NorMuon (official code's preserve-norm scaling)", "Li et al. 2025",
         "https://arxiv.org/abs/2510.05491", '`pytorch_optimizer.NorMuon(update_scale="preserve_norm")`', "package",
         "llama", _normuon("preserve_norm"), 3e-6, _NS32, 3e-5, _LOSS, rule=llama_rule, patches=NS_FP32),
    Case("normuon-rms", "NorMuon (Algorithm 1, RMS 0.2)", "Li et al. 2025", "https://arxiv.org/abs/2510.05491",
         '`pytorch_optimizer.NorMuon(update_scale="match_rms")`', "package", "llama", _normuon("match_rms"), 3e-6,
         _NS32, 3e-5, _LOSS, rule=llama_rule, patches=NS_FP32),
    Case("adamuon", "AdaMuon", "Si et al. 2025", "https://arxiv.org/abs/2507.11005",
         "`pytorch_optimizer.AdaMuon(use_adjusted_lr=True)`", "package", "llama", _adamuon, 3e-6, _NS32, 5e-5, _LOSS,
         rule=llama_rule, patches=NS_FP32),
    Case("polargrad", "PolarGrad (with momentum)", "Lau, Long & Su 2025", "https://arxiv.org/abs/2505.21799",
         "the paper's update in float64 (SVD); `torch.optim.AdamW(fused=True)`", "transcription", "llama", _polargrad,
         2e-6, "geomopt's SVD and nuclear-norm scale are float32, the transcription's float64",
         0.2, "at initialization the LM loss's gradients of q_proj and o_proj are ill-conditioned (σ_min/σ₁ ≈ 8e-4 "
               "and 2e-5 at the first step: grouped-query heads share values); the polar factor amplifies rounding "
               "by about σ₁/σ_min there, so float32 and float64 runs drift apart (measured up to 4e-2 after 6 steps, "
               "1.5e-3 with geomopt's SVD in float64; tests/test_catalog.py checks only that they stay within 0.2)",
         rule=llama_rule),
    Case("shampoo", "Shampoo", "Gupta, Koren & Singer 2018", "https://arxiv.org/abs/1802.09568",
         "`pytorch_optimizer.Shampoo(matrix_eps=1e-3, preconditioning_compute_steps=1)`; "
         "`torch.optim.AdamW(fused=True)`", "package", "llama", _shampoo, 1e-4,
         "the peer's roots are a float32 SVD of each factor, geomopt's a float64 eigh (float32 rounding of the "
         "factors' small eigenvalues, raised to −1/4)", 3e-5, _LOSS, rule=llama_rule),
    Case("scalable-shampoo", "Scalable Shampoo (AdaGrad graft)", "Anil et al. 2020", "https://arxiv.org/abs/2002.09018",
         "`pytorch_optimizer.ScalableShampoo(betas=(0, 0.99), preconditioning_compute_steps=4, use_svd=True, "
         "graft_type=ADAGRAD)`; `torch.optim.AdamW(fused=True)`", "package", "llama", _scalable_shampoo, 5e-6,
         "the peer's roots are a float32 SVD of each factor, geomopt's a float64 eigh, and the peer's damping is "
         "β₂ᵗ·ε (its factors start at ε·I), geomopt's ε; roots every 4 steps, 8 steps: a factor of two gradients "
         "(64 vectors in 64 dimensions for the MLP's long sides) has eigenvalues near 0, where both differences "
         "show (every 2: 3e-4); measured 7e-7, and 1.4e-3 with β 0.98, 0.14 with every 3",
         1e-2, "on the loss, the first gradients of q_proj and k_proj are so small (‖G‖ ≈ 2e-3; the factors' "
         "(1 − β₂)·G·Gᵀ ≈ 1e-8) that the damping ε = 1e-6 makes most of their factors, and the peer's has decayed "
         "to β₂ᵗ·ε: their directions differ by ~5e-3 (measured 4.7e-3; 7e-2 with β 0.98)",
         rule=llama_rule, steps=8),
    Case("soap", "SOAP", "Vyas et al. 2024", "https://arxiv.org/abs/2409.11321",
         "`pytorch_optimizer.SOAP(max_precondition_dim=16 on k_proj, v_proj; 32 on the other hidden "
         "matrices)`; `torch.optim.AdamW(fused=True)`", "package", "llama", _soap, 1e-4,
         "SOAP's float32 eigh and QR of the factors in different op orders (the peer's per matrix, geomopt's "
         "batched). A rectangular matrix keeps its short side's factor only: its long side's Gᵀ·G has rank at most "
         "the short side, and the eigenbasis on that null space is decided by rounding (two correct SOAPs differ "
         "by O(1) there), so both keep each matrix's full-rank side (max_dim, the peer's max_precondition_dim); "
         "measured 3.4e-5, and 0.22 with every 3, 1.8e-3 with betas [0.95, 0.96], 4e-2 with kv's β 0.9",
         0.5, "on the loss, as in soap-muon: the first gradients of q_proj and o_proj are ill-conditioned (o_proj's "
         "input, heads that share a key-value group under near-uniform attention, spans about half its width), "
         "and two float32 eigh take the eigenvectors of their nearly equal small eigenvalues apart; the rotated "
         "second moment follows them and the difference feeds back into every gradient (measured 0.31 after 6 "
         "steps, whatever one coefficient: this mode checks only that the runs stay within 0.5)",
         rule=soap_rule),
    Case("psgd-kron", "PSGD-Kron", "Li 2018", "https://arxiv.org/abs/1809.10232",
         "`pytorch_optimizer.Kron(momentum=0.9, pre_conditioner_update_probability=1.0, balance_prob=1.0)`; "
         "`torch.optim.AdamW(fused=True)`", "package", "llama", _psgd_kron, 2e-6,
         "both fit and apply the factors in float32, in different op orders (the peer's einsums per matrix, "
         "geomopt's batched matmuls), on the same probes (the peer's draws replaced by geomopt's, seeded by the "
         "step); "
         "measured 4e-7, and 1.5e-2 with precond_lr 0.11, 9e-3 with momentum 0.91",
         5e-5, _LOSS, rule=llama_rule, patches=PSGD_PROBES),
    Case("soap-muon", "SOAP on attention, Muon on the rest", "Vyas et al. 2024; Jordan et al. 2024",
         "https://arxiv.org/abs/2409.11321",
         "`pytorch_optimizer.SOAP` + `torch.optim.Muon` + `torch.optim.AdamW(fused=True)`", "package", "llama",
         _soap_muon, 1e-4,
         "SOAP's float32 eigh and QR of the factors in different op orders (the peer's per matrix, geomopt's "
         "batched): their eigenvectors turn by rounding over the ratio of nearby eigenvalues; Muon bit for bit",
         0.5, "on the loss, the first gradients of q_proj and o_proj are ill-conditioned (see polargrad): nearly equal "
         "small eigenvalues of the factors, whose eigenvectors two float32 eigh take apart by rounding, and the "
         "rotated second moment follows them (measured 0.32 after 6 steps; tests/test_catalog.py checks only that "
         "the runs stay within 0.5; tests/test_kronecker_geometry.py holds SOAP to 1e-6 in float64)",
         rule=soap_muon_rule, spec_edit=_pin_ns_dtype("bfloat16")),
    Case("dion", "Dion (rank 1/4)", "Ahn et al. 2025", "https://arxiv.org/abs/2504.05295",
         "Algorithm 1 (microsoft/dion's `dion_simple.py`) in float64; `torch.optim.AdamW(fused=True)`",
         "transcription", "llama", _dion, 2e-6, _F64_DION, 1e-5, _LOSS, rule=llama_rule),
    Case("muon-gram-ns", "Muon with Gram Newton–Schulz", "Dao AI Lab 2026",
         "https://dao-lab.ai/blog/2026/gram-newton-schulz/",
         '`pytorch_optimizer.Muon(ns_method="gram_newton_schulz")`', "package", "llama", _gram_muon, 3e-5, _GRAM,
         1e-4, _LOSS, rule=llama_rule, patches=(_fp32(f"{_PO}.muon.base", "zero_power_via_gram_newton_schulz"),)),
    Case("muon-moonlight", "Muon, Moonlight's AdamW-matched scale", "Liu et al. 2025",
         "https://arxiv.org/abs/2502.16982",
         '`torch.optim.Muon(adjust_lr_fn="match_rms_adamw")` + `torch.optim.AdamW(fused=True)`',
         "package", "llama", _moonlight, 0.0,
         _BIT + ": both run Newton–Schulz in bf16 (the test pins the spec's dtype: torch's Muon is bf16 always)",
         1e-2, "on the loss's own gradients, bit for bit for 4 steps on every CPU tried; on an AVX-512 CPU one float32 "
         "rounding differs at step 5 (1.9e-5 on one tensor) and bf16 Newton–Schulz lifts it to ~2e-3 by step 6 (the "
         "same gradients stay bit for bit)", rule=llama_rule, spec_edit=_pin_ns_dtype("bfloat16")),
    Case("muon-polar-express", "Muon with Polar Express", "Amsel et al. 2025", "https://arxiv.org/abs/2505.16932",
         "`pytorch_optimizer.Muon(ns_coeffs=<Algorithm 1's list>)`", "package", "llama", _polar_express_muon, 3e-6,
         _NS32, 3e-5, _LOSS, rule=llama_rule, patches=NS_FP32),
    Case("muonclip", "MuonClip (Muon + QK-clip, on MLA)", "Kimi Team 2025", "https://arxiv.org/abs/2507.20534",
         "`pytorch_optimizer.MuonClip(qk_clip_threshold=100, qk_clip_alpha=0.5, use_adjusted_lr=True)`, its clip "
         "groups (`query`, `query_rotary`, `key`) on the per-head rows of an MLA model, the logits written out in "
         "float64 (`tests/catalog_mla.py`)", "package", "mla-clip", _muonclip, 5e-6,
         _NS32 + "; the clip's logits are float32 (SDPA's) here, float64 there, and the ×70 query/key rows round "
         "at u·‖X‖ against steps of lr 2e-4", 1e-4, _LOSS, rule=mla_rule,
         patches=NS_FP32, logits=True),
    Case("namo", "NAMO (norm-adaptive Muon)", "arXiv:2602.17080 (2026)", "https://arxiv.org/abs/2602.17080",
         'NVIDIA Emerging-Optimizers\' `AdaptiveMuon(moment2_method="namo")`, written out in `tests/catalog_eo.py`; '
         '`torch.optim.AdamW(fused=True)`', "transcription", "llama", _namo, 3e-6, _EO32, 3e-5, _LOSS,
         rule=llama_rule),
    Case("muon-hyperball", "Hyperball Muon (MuonH)", "NVIDIA Emerging-Optimizers 2025",
         "https://github.com/NVIDIA-NeMo/Emerging-Optimizers",
         'NVIDIA Emerging-Optimizers\' `MuonHyperball(hyperball_radius=1.0)`, written out in `tests/catalog_eo.py`; '
         '`torch.optim.AdamW(fused=True)`', "transcription", "llama", _muon_hyperball, 3e-6,
         _EO32 + "; both normalize by ‖·‖_F (+ ε here, max(·, ε) there)", 3e-5, _LOSS,
         rule=llama_rule),
    Case("spel", "SPEL (spectral descent on the Stiefel manifold)", "arXiv:2601.21487 (2026)",
         "https://arxiv.org/abs/2601.21487",
         "NVIDIA Emerging-Optimizers' `Spel`, written out in `tests/catalog_eo.py`; `torch.optim.AdamW(fused=True)`",
         "transcription", "llama", _spel, 5e-6, _EO32 + "; the retraction's Newton–Schulz too", 3e-5, _LOSS,
         rule=llama_rule),
    Case("polargrad-ns", "PolarGrad (Newton–Schulz polar factor)", "Lau, Long & Su 2025",
         "https://arxiv.org/abs/2505.21799",
         "NVIDIA Emerging-Optimizers' `PolarGrad`, written out in `tests/catalog_eo.py`; "
         "`torch.optim.AdamW(fused=True)`",
         "transcription", "llama", _polargrad_ns, 3e-6, _EO32, 1e-4,
         _LOSS + "; here too the ill-conditioned first gradients of q_proj and o_proj (see polargrad) amplify it",
         rule=llama_rule),
    Case("muon-cans", "Muon with CANS orthogonalization", "Grishina et al. 2025", "https://arxiv.org/abs/2506.10935",
         "NVIDIA Emerging-Optimizers' `Muon(coefficient_type=\"cans\")`, written out in `tests/catalog_eo.py`; "
         "`torch.optim.AdamW(fused=True)`", "transcription", "llama", _muon_cans, 1e-5,
         _EO32 + "; CANS's first quintic (coefficients up to 25) amplifies that rounding about 5× more than Muon's",
         3e-5, _LOSS,
         rule=llama_rule),
    Case("turbo-muon", "Turbo-Muon (AOL-preconditioned Newton–Schulz, 4 steps)", "Boissin et al. 2025",
         "https://arxiv.org/abs/2512.04632",
         "NVIDIA Emerging-Optimizers' `Muon(num_ns_steps=4, coefficient_type=\"aol\")` with the authors' AOL "
         "rescaling (github.com/thib-s/flash-newton-schulz) in its Newton–Schulz, written out in "
         "`tests/catalog_eo.py`; `torch.optim.AdamW(fused=True)`", "transcription", "llama", _turbo_muon, 3e-6,
         "the Newton–Schulz iterations are the same ops bit for bit (tests/test_aol.py); decoupled decay as "
         "p + (−λγ)p there, X(1 − γλ) here, and the update's scale and sum: fp32 rounding", 3e-5, _LOSS,
         rule=llama_rule),
    Case("muon-plus", "Muon+ (row, then column normalization)", "arXiv:2602.21545 (2026)",
         "https://arxiv.org/abs/2602.21545",
         "the authors' `MuonPlus(norm_mode=\"row_col\")` (github.com/K1seki221/MuonPlus), written out in "
         "`tests/catalog_muon_variants.py`; `torch.optim.AdamW(fused=True)`", "transcription", "llama", _muon_plus,
         3e-6, _VAR32, 3e-5, _LOSS, rule=llama_rule),
    Case("normuon-hyperball", "NorMuonH (NorMuon on the hyperball)", "modded-nanogpt track 3, 2026",
         "https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization",
         "the record's `NorMuonH` (20260430_normuonh), written out in `tests/catalog_muon_variants.py`; "
         "`torch.optim.AdamW(fused=True)`", "transcription", "llama", _normuon_hyperball, 5e-6,
         _VAR32 + " (12 steps here); v clamped at 1e-10 there, + 1e-10 under the root here; the sphere rounds X at "
         "u·‖X‖ each step, and the steps move X by only ~0.1‖X‖", 3e-5, _LOSS, rule=llama_rule),
    Case("contra-muon", "Contra-Muon", "Nilin 2026", "https://github.com/nilin/contra-muon",
         "the author's first code (modded-nanogpt PR #275, `muon_update`, CONTRA_MUON = 0.4) without the record's "
         "NorMuon-lite and u/w floor, written out in `tests/catalog_muon_variants.py`; `torch.optim.AdamW(fused=True)`",
         "transcription", "llama", _contra_muon, 1e-6, _VAR32 + "; the power iteration too", 5e-5,
         _LOSS + "; o_proj's ill-conditioned first gradients (see polargrad) amplify it",
         rule=llama_rule),
    Case("scion", "Scion", "Pethick et al. 2025", "https://arxiv.org/abs/2502.07529",
         "Scion's update rules (`tests/test_equivalence.py`)", "transcription", "gpt", _scion(True),
         2e-6, _SCION, 1e-5, _SCION, rule=gpt_scion_rule, same_as="scion"),
    Case("uscion", "uScion (unconstrained Scion)", "Pethick et al. 2025", "https://arxiv.org/abs/2502.07529",
         "Scion's update rules (`tests/test_equivalence.py`)", "transcription", "gpt", _scion(False),
         2e-6, _SCION, 1e-5, _SCION, rule=gpt_scion_rule, same_as="uscion"),
    Case("spectral-clip", "uScion + spectral-ball clipping", "this package's paper", None,
         "Scion's update rules, then float64 SVD clipping", "brute force", "gpt-clip",
         lambda m: ScionThenSet(m, clip_spectrum, clip_spectrum, lr=0.02), 2e-6,
         _SCION + "; the clipping is float64 here", 1e-5, _SCION, rule=gpt_scion_rule, same_as="spectral-clip"),
    Case("hyperball", "Hyperball (Frobenius-sphere prox)", "this package's paper", None,
         "Scion's update rules, then the sphere prox by scipy SLSQP in float64", "brute force", "gpt",
         lambda m: ScionThenSet(m, sphere_prox, fro_sphere_init, lr=0.02), 1e-5,
         _SCION + "; the prox is solved by SLSQP in float64", 2e-5, _SCION, rule=gpt_scion_rule,
         same_as="hyperball"),
]


# ---------------------------------------------------------------- running a case


def state_elements(state: dict) -> int:
    """Elements of the tensors (of at least one dimension: not step counters) an optimizer keeps."""
    return sum(v.numel() for st in state.values() for v in st.values() if torch.is_tensor(v) and v.ndim > 0)


@contextlib.contextmanager
def patched(patches, setattr_fn=None):
    """Apply ``patches`` ((module, attribute, original → replacement)); with pytest's
    ``monkeypatch.setattr`` as ``setattr_fn`` it undoes them, else they are undone on exit here."""
    undo = []
    try:
        for module, attr, make in patches:
            mod = importlib.import_module(module)
            if not hasattr(mod, attr):
                continue  # this version of the package does not have it
            new = make(getattr(mod, attr))
            if setattr_fn is not None:
                setattr_fn(mod, attr, new)
            else:
                undo.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, new)
        yield
    finally:
        for mod, attr, old in reversed(undo):
            setattr(mod, attr, old)


def set_random_grads(model: nn.Module, step: int) -> None:
    """Standard normal gradients, the same for every model at step ``step``."""
    g = torch.Generator().manual_seed(2000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def load(case: Case):
    """The catalogue spec, with the case's edit (a pinned dtype) where it has one."""
    from geomopt.spec.model import Spec

    spec = geomopt.load_spec(case.path)
    return Spec.model_validate(case.spec_edit(spec.model_dump())) if case.spec_edit else spec


def run(case: Case, mode: str = "same", setattr_fn=None) -> dict:
    """Both optimizers for ``case.steps`` steps, in ``mode`` (:data:`MODES`); the comparison's figures."""
    from geomopt.geometry.dtypes import BF16Warning

    model = MODELS[case.model]()
    ref_model = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with patched(case.patches, setattr_fn), warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)  # bf16 on purpose (the Muon cases), on tiny matrices
        opt = geomopt.GeomOptimizer(model, load(case))
        ref = case.build(ref_model)
        monitor = geomopt.monitor_attention(model) if case.logits else None
        t0 = time.perf_counter()
        for k in range(case.steps):
            for m in (model, ref_model):
                m.zero_grad(set_to_none=True)
                if mode == "loss":
                    loss_fn(m, k).backward()
                else:
                    if case.logits:  # the step's forward gives the logits a clip reads; its gradients are replaced
                        loss_fn(m, k)
                    set_random_grads(m, k)
            opt.step()
            ref.step()
        seconds = time.perf_counter() - t0
        if monitor is not None:
            monitor.remove()
    worst, worst_name, num, den = 0.0, None, 0.0, 0.0
    unmoved, per_tensor = [], {}
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        diff = float((p.detach().double() - q.detach().double()).norm())
        moved = float((q.detach().double() - start[n].double()).norm())
        if moved == 0:
            unmoved.append(n)
            continue
        num, den = num + diff**2, den + moved**2
        per_tensor[n] = diff / moved
        if diff / moved >= worst:
            worst, worst_name = diff / moved, n
    routing = {n: opt.plan[n].rule for n, _ in model.named_parameters()}
    rule = case.rule or (lambda n, p: "all")  # the one-rule specs: every tensor to rule `all`
    expected = {n: rule(n, p) for n, p in model.named_parameters()}
    return dict(key=case.key, mode=mode, steps=case.steps, max_rel=worst, worst_tensor=worst_name,
                global_rel=math.sqrt(num / den) if den else float("nan"), unmoved=unmoved,
                state_geomopt=state_elements(opt.state), state_reference=state_elements(ref.state),
                routing_ok=routing == expected, seconds=seconds, active=getattr(ref, "active", None),
                params=sum(p.numel() for p in model.parameters()), model=case.model, per_tensor=per_tensor)
