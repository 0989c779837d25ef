"""Multi-head latent attention (MLA) for the QK-clip tests and the ``muonclip`` catalogue case: a
tiny Hugging Face ``DeepseekV3ForCausalLM`` and its attention logits written out from the
DeepSeek-V2/V3 papers' definition, in float64, from a module's weights and its input only.

For input x (B, T, E) and head h (DeepSeek-V2, arXiv 2405.04434 §2.1.2–2.1.3; Kimi K2, arXiv
2507.20534 §2.1)::

    c_Q = RMSNorm(x W_qa)            q^h = c_Q W_qb^h = [q_C^h, q_R^h]      (W_q^h without a query LoRA)
    [c_KV, k_R] = x W_kva            k_C^h = RMSNorm(c_KV) W_kvb^h[:nope]   (value rows follow)
    S^h_ij = (q_C^h_i·k_C^h_j + RoPE_i(q_R^h_i)·RoPE_j(k_R_j)) / √(nope + rope),   j ≤ i

RoPE rotates pairs of entries by the angle pos·θ^(−2m/rope), θ = 10000: the pairs (2m, 2m+1)
where the model's ``rope_interleave`` is set (DeepSeek's layout), else (m, m + rope/2).

:class:`MuonClipMLA` is ``pytorch_optimizer.MuonClip`` used as it ships on such a model: its
update on whole tensors, its clip on the per-head parts as its docstring asks for MLA ("separate
content and rotary groups"), here views into the model's tensors, given the logits above.
"""

from __future__ import annotations

import copy
import functools
import math
import os

import torch
from torch import nn

MLA_CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
               v_head_dim=8, first_k_dense_replace=2, max_position_embeddings=32)


def mla(attn: str = "sdpa", scale: float = 1.0, **overrides) -> nn.Module:
    """``DeepseekV3ForCausalLM`` from :data:`MLA_CFG` (dense MLPs, no MoE), random init (seed 0),
    train mode; the per-head query/key parts (q_b_proj or q_proj, kv_b_proj's key rows, the rotary
    key rows of kv_a_proj_with_mqa) × ``scale``, so the logits (∝ scale²) reach a clip's τ."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**{**MLA_CFG, **overrides}, attn_implementation=attn)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            (a.q_b_proj if cfg.q_lora_rank else a.q_proj).weight.mul_(scale)
            a.kv_b_proj.weight.view(cfg.num_attention_heads, nope + v, -1)[:, :nope].mul_(scale)
            a.kv_a_proj_with_mqa.weight[cfg.kv_lora_rank:].mul_(scale)
    model.train()
    return model


@functools.lru_cache(maxsize=1)
def _clip_template() -> nn.Module:
    return mla(scale=70.0)


def mla_clip() -> nn.Module:
    """The catalogue's MLA model: :func:`mla` with the query/key parts × 70, so that the heads'
    largest logits on the catalogue's batches (≈ 55–170) cross the report's τ = 100 on most steps
    and stay under it on others. Built once, copied per case."""
    return copy.deepcopy(_clip_template())


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.detach().double()


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ layer.weight.detach().double().T
    return y if layer.bias is None else y + layer.bias.detach().double()


def _rope(x: torch.Tensor, interleave: bool, theta: float = 10000.0) -> torch.Tensor:
    """x (B, T, …, d) rotated pairwise by the angle t·θ^(−2m/d) at position t (float64)."""
    t, d = x.shape[1], x.shape[-1]
    ang = torch.arange(t, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = ang.view(1, t, *([1] * (x.ndim - 3)), d // 2)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : d // 2], x[..., d // 2:])
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)


def mla_logits(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """S (B, H, T, T) of one MLA module on its input ``x`` (B, T, E), float64, causal entries only
    (the others −∞), from the definition above."""
    cfg = attn.config
    h, nope, rope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    x = x.detach().double()
    b, t, _ = x.shape
    if cfg.q_lora_rank:
        q = _linear(attn.q_b_proj, _rms(_linear(attn.q_a_proj, x), attn.q_a_layernorm.weight, cfg.rms_norm_eps))
    else:
        q = _linear(attn.q_proj, x)
    q = q.view(b, t, h, nope + rope)
    ckv = _linear(attn.kv_a_proj_with_mqa, x)
    c, k_r = _rms(ckv[..., :r], attn.kv_a_layernorm.weight, cfg.rms_norm_eps), ckv[..., r:]
    k_c = _linear(attn.kv_b_proj, c).view(b, t, h, -1)[..., :nope]
    q_r, k_r = _rope(q[..., nope:], cfg.rope_interleave), _rope(k_r, cfg.rope_interleave)
    s = torch.einsum("bihd,bjhd->bhij", q[..., :nope], k_c) + torch.einsum("bihd,bjd->bhij", q_r, k_r)
    s = s / math.sqrt(nope + rope)
    return s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)


class Inputs:
    """Forward pre-hooks that keep each MLA module's input of the training forwards (by module
    name) until :meth:`maxima` turns them into per-head max logits (float64) and forgets them."""

    def __init__(self, model: nn.Module):
        self.seen: dict[str, list] = {}
        self.modules = {n: m for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3Attention"}
        self.handles = [m.register_forward_pre_hook(self._hook(n), with_kwargs=True) for n, m in self.modules.items()]

    def _hook(self, name: str):
        def hook(_mod, args, kwargs):
            if torch.is_grad_enabled():
                self.seen.setdefault(name, []).append((args[0] if args else kwargs["hidden_states"]).detach().clone())
        return hook

    def maxima(self) -> dict[str, torch.Tensor]:
        out = {n: torch.stack([mla_logits(self.modules[n], x).amax(dim=(0, 2, 3)) for x in xs]).amax(0)
               for n, xs in self.seen.items()}
        self.seen.clear()
        return out

    def remove(self) -> None:
        for hd in self.handles:
            hd.remove()


def clip_groups(model: nn.Module) -> list[dict]:
    """pytorch-optimizer MuonClip's QK-clip groups for an MLA model: per attention module, views
    (heads first) into its tensors of q_C (``query``), q_R (``query_rotary``) and k_C (``key``);
    no gradients, so its update skips them and only its clip writes them (in place, through the
    views). The shared rotary key is in no group: the package leaves it as it is."""
    groups = []
    for name, a in model.named_modules():
        if type(a).__name__ != "DeepseekV3Attention":
            continue
        cfg = a.config
        h, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = (a.q_b_proj if cfg.q_lora_rank else a.q_proj).weight.detach().view(h, nope + rope, -1)
        k = a.kv_b_proj.weight.detach().view(h, nope + v, -1)
        for role, view in (("query", q[:, :nope]), ("query_rotary", q[:, nope:]), ("key", k[:, :nope])):
            groups.append(dict(params=[nn.Parameter(view, requires_grad=False)], use_muon=False, lr=0.0,
                               weight_decay=0.0, qk_clip=role, attention_name=name))
    return groups


class MuonClipMLA:
    """``pytorch_optimizer.MuonClip(groups + clip_groups(model), **kw)`` stepped with the per-head
    max logits of the model's training forwards since the last step (:class:`Inputs`)."""

    def __init__(self, model: nn.Module, groups: list[dict], **kw):
        from pytorch_optimizer import MuonClip

        self.inputs = Inputs(model)
        self.opt = MuonClip(groups + clip_groups(model), **kw)
        self.state = self.opt.state

    def step(self):
        self.opt.step(attention_max_logits=self.inputs.maxima())
