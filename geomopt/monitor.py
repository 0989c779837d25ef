"""The attention monitor: per-head maxima of the pre-softmax logits, for QK-clip.

``handle = geomopt.monitor_attention(model)`` (once, after the model is built; ``handle.remove()``
detaches it) finds the model's attention modules (:func:`attention_sites`) and, during each of
their forwards, watches the attention op through a :class:`torch.overrides.TorchFunctionMode`
entered by a forward pre-hook and left by a forward hook (``always_call``, so an exception in the
forward leaves no mode behind):

* ``F.scaled_dot_product_attention(q, k, v, attn_mask, …, is_causal, scale, enable_gqa)``: the
  fused kernel never shows its scores, so the monitor computes them once more,
  S = q·kᵀ·scale (scale = 1/√d unless given; grouped keys repeated), masked as the kernel masks
  them (``is_causal``: top-left lower triangle; a boolean mask keeps True, a float mask is added),
  and keeps max over batch and positions per head. Cost: one extra matmul of the size of the
  attention scores per call, in chunks of the batch of at most 2²⁶ scores (≈ the eager path's
  QKᵀ; benchmarks/qk_monitor.py measures it);
* ``softmax`` of a 4-D tensor with the heads on axis 1 (Hugging Face's eager attention: the
  scores, mask added, go through one softmax): one ``amax`` over the scores it already has.

Only forwards with gradients enabled count (training forwards; an eval pass under ``no_grad`` does
not), and the maxima accumulate (max) over every such forward until the optimizer's QK-clip
consumes them after a step (:mod:`geomopt.optim.engine.qkclip`): with gradient accumulation, the max over
the step's micro-batches, as the Kimi K2 report (arXiv 2507.20534 §2.1) takes S_max over the batch.
A max stays on the device (no host sync per call).

An attention site (:class:`Site`) is a module with separate ``q_proj`` and ``k_proj`` linear layers
(Hugging Face Llama, Mistral, Qwen, …; grouped-query attention included) or a fused ``c_attn``
(geomopt's GPT: ``nn.Linear`` (3E, E); GPT-2: ``Conv1D`` (E, 3E)) whose head counts it states
(``num_heads``/``n_head``/``config.num_attention_heads``, ``num_key_value_heads``, ``head_dim``),
or multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2; :func:`_mla_site`). In MLA the
logit of head h is q_C^h·k_C^h + q_R^h·k_R: the per-head non-rotary query q_C^h and rotary query
q_R^h are head h's rows of ``q_b_proj`` (``q_proj`` without a query LoRA), each head's
``qk_nope_head_dim`` rows then its ``qk_rope_head_dim`` rows; the per-head non-rotary key k_C^h
is the first ``qk_nope_head_dim`` of head h's rows of ``kv_b_proj`` (its value rows follow); the
rotary key k_R (the last rows of ``kv_a_proj_with_mqa``) and the latents (``q_a_proj``, the rest
of ``kv_a_proj_with_mqa``) are shared by every head. Its scores reach the monitor as those of any
attention, through SDPA (scale: the module's own, passed to the kernel) or the eager softmax.
``nn.MultiheadAttention`` is refused with the reason (:func:`attention_sites`' second value).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from geomopt.compile.roles.structure import stated_count

__all__ = ["AttentionMonitor", "Part", "Site", "attention_sites", "find_monitored", "monitor_attention",
           "sdpa_head_max", "watching_any"]

_CHUNK = 1 << 26  # scores computed at once by the SDPA observer
_SDPA = F.scaled_dot_product_attention  # as torch defines it (a later patch of F does not hide it)
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_MLA = ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa", "q_a_proj")


@dataclasses.dataclass(frozen=True)
class Part:
    """The query or key entries of one projection tensor along ``axis`` (0: ``nn.Linear``'s
    (out, in) weight or a bias; 1: a Hugging Face ``Conv1D``'s (in, out) weight): head h's
    ``head_dim`` entries at offset + h·stride + first (stride 0: head_dim, the heads' blocks
    consecutive). ``kind`` says which factor of η_h the clip gives them: ``q`` (η^α), ``k``
    (η^(1−α)), ``q_rope`` (η: MLA's per-head rotary query, whose key k_R is shared)."""

    kind: str  # "q", "k" or "q_rope"
    axis: int
    offset: int
    heads: int
    head_dim: int
    stride: int = 0
    first: int = 0

    def block(self, p: torch.Tensor) -> torch.Tensor:
        """The part of ``p`` as a view with the heads on ``axis`` and their entries on axis + 1."""
        stride = self.stride or self.head_dim
        span = p.narrow(self.axis, self.offset, self.heads * stride).unflatten(self.axis, (self.heads, stride))
        return span.narrow(self.axis + 1, self.first, self.head_dim)


@dataclasses.dataclass(eq=False)
class Site:
    """One attention module: its head counts, its query/key tensors (weights and biases, by
    parameter name, each with its :class:`Part` s) and the per-head maxima observed so far."""

    name: str
    module: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    tensors: dict  # parameter name → (parameter, [Part, …])
    weights: tuple  # names of the projection weights (the tensors a QK-clip rule must cover)
    shared: dict = dataclasses.field(default_factory=dict)  # MLA: parameter name → the head-shared value it gives
    maxima: Optional[torch.Tensor] = None  # (heads,) float32: max logit per query head
    observed: int = 0  # attention ops seen
    blind: int = 0  # training forwards of the module in which no attention op was seen

    def observe(self, head_max: torch.Tensor) -> None:
        m = head_max.detach().float()
        self.maxima = m if self.maxima is None else torch.maximum(self.maxima, m)
        self.observed += 1


def _site(name: str, mod: nn.Module, prefix: str) -> tuple[Optional[Site], Optional[str]]:
    """(a site, None), (None, why it is refused) or (None, None): not an attention module."""
    children = dict(mod.named_children())
    if any(c in children for c in _MLA):
        return _mla_site(name, mod, prefix, children)
    if isinstance(mod, nn.MultiheadAttention):
        return None, "nn.MultiheadAttention: its fused kernel computes the logits where no monitor sees them"
    heads = stated_count(mod, "num_heads", "num_attention_heads", "n_head", "n_heads")
    q, k, fused = children.get("q_proj"), children.get("k_proj"), children.get("c_attn")
    if heads is None or (fused is None and (q is None or k is None)) or getattr(mod, "is_cross_attention", False):
        return None, None
    kv = stated_count(mod, "num_key_value_heads", "num_kv_heads", "n_kv_heads") or heads
    tensors: dict = {}
    weights: tuple[str, ...]
    if q is not None and k is not None:
        if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear)):
            return None, "q_proj/k_proj are not nn.Linear layers"
        hd = stated_count(mod, "head_dim") or q.weight.shape[0] // heads
        if q.weight.shape[0] != heads * hd or k.weight.shape[0] != kv * hd or heads % kv:
            return None, f"q_proj/k_proj rows ({q.weight.shape[0]}, {k.weight.shape[0]}) are not {heads}/{kv} heads"
        for lname, layer, part in (("q_proj", q, Part("q", 0, 0, heads, hd)), ("k_proj", k, Part("k", 0, 0, kv, hd))):
            for pname, p in layer.named_parameters(recurse=False):
                tensors[f"{prefix}{lname}.{pname}"] = (p, [part])
        weights = (f"{prefix}q_proj.weight", f"{prefix}k_proj.weight")
    else:
        assert fused is not None
        w = getattr(fused, "weight", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 2:
            return None, None
        axis = 1 if type(fused).__name__ == "Conv1D" else 0
        out, d_in = w.shape[axis], w.shape[1 - axis]
        hd = stated_count(mod, "head_dim") or d_in // heads
        if out != (heads + 2 * kv) * hd or heads % kv:
            return None, f"c_attn's {out} outputs are not q, k, v of {heads}/{kv} heads of {hd}"
        for pname, p in fused.named_parameters(recurse=False):
            ax = axis if p.ndim == 2 else 0
            tensors[f"{prefix}c_attn.{pname}"] = (p, [Part("q", ax, 0, heads, hd), Part("k", ax, heads * hd, kv, hd)])
        weights = (f"{prefix}c_attn.weight",)
    return Site(name, mod, heads, kv, hd, tensors, weights), None


def _mla_site(name: str, mod: nn.Module, prefix: str, children: dict) -> tuple[Optional[Site], Optional[str]]:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; Hugging Face's ``DeepseekV3Attention``
    layout): the per-head parts q_C, q_R (``q_b_proj``, or ``q_proj`` without a query LoRA) and
    k_C (``kv_b_proj``); the head-shared tensors (``q_a_proj``, ``kv_a_proj_with_mqa``: the latents
    and the rotary key k_R) in ``Site.shared``, never clipped. Every head has its own k_C, so the
    site has as many key heads as query heads."""
    what = "multi-head latent attention (MLA)"
    heads = stated_count(mod, "num_heads", "num_attention_heads", "n_head", "n_heads")
    nope, rope, v = (stated_count(mod, a) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q = children.get("q_b_proj") if "q_b_proj" in children else children.get("q_proj")
    kv, kv_a = children.get("kv_b_proj"), children.get("kv_a_proj_with_mqa")
    if heads is None or nope is None or rope is None or v is None:
        return None, (f"{what} without stated head counts and dims (num_heads, qk_nope_head_dim, "
                      f"qk_rope_head_dim, v_head_dim on the module or its config): QK-clip cannot tell its heads apart")
    if not all(isinstance(x, nn.Linear) for x in (q, kv, kv_a)):
        return None, (f"{what} without nn.Linear q_b_proj (or q_proj), kv_b_proj and kv_a_proj_with_mqa: "
                      f"QK-clip knows only DeepSeek-V3's layout")
    assert q is not None and kv is not None and kv_a is not None
    if q.weight.shape[0] != heads * (nope + rope) or kv.weight.shape[0] != heads * (nope + v):
        return None, (f"{what}: {q.weight.shape[0]} query rows and {kv.weight.shape[0]} kv_b_proj rows are not "
                      f"{heads} heads of {nope} + {rope} (query) and {nope} + {v} (key, value)")
    qname = "q_b_proj" if "q_b_proj" in children else "q_proj"
    tensors: dict = {}
    for pname, p in q.named_parameters(recurse=False):
        tensors[f"{prefix}{qname}.{pname}"] = (p, [Part("q", 0, 0, heads, nope, nope + rope),
                                                   Part("q_rope", 0, 0, heads, rope, nope + rope, nope)])
    for pname, p in kv.named_parameters(recurse=False):
        tensors[f"{prefix}kv_b_proj.{pname}"] = (p, [Part("k", 0, 0, heads, nope, nope + v)])
    shared = {f"{prefix}kv_a_proj_with_mqa.{n}": "the key-value latent and the rotary key k_R"
              for n, _ in kv_a.named_parameters(recurse=False)}
    if "q_b_proj" in children and isinstance(children.get("q_a_proj"), nn.Module):
        shared.update({f"{prefix}q_a_proj.{n}": "the query latent"
                       for n, _ in children["q_a_proj"].named_parameters(recurse=False)})
    return Site(name, mod, heads, heads, nope + rope, tensors, (f"{prefix}{qname}.weight", f"{prefix}kv_b_proj.weight"),
                shared=shared), None


def attention_sites(model: nn.Module) -> tuple[list[Site], dict[str, str]]:
    """The model's attention sites, and the attention-like modules refused (module name → why)."""
    sites, refused = [], {}
    for name, mod in model.named_modules():
        site, why = _site(name, mod, f"{name}." if name else "")
        if site is not None:
            sites.append(site)
        elif why is not None:
            refused[name] = why
    return sites, refused


def sdpa_head_max(query, key, value=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False) -> torch.Tensor:
    """max over batch and positions of S = q·kᵀ·scale, per query head (float32, shape (heads,)), for
    the arguments of ``F.scaled_dot_product_attention``; masked entries do not count. The scores
    and masks are torch's own definition of SDPA (its documented math reference: scale 1/√d by
    default, ``is_causal`` the top-left lower triangle, a boolean mask keeps True, a float mask
    is added, ``enable_gqa`` repeats each key head over its group); the max is S_max^h of the
    Kimi K2 report (arXiv 2507.20534 §2.1)."""
    with torch.no_grad():
        q, k = query.detach(), key.detach()
        heads, length, d = q.shape[-3], q.shape[-2], q.shape[-1]
        q = q.reshape(-1, heads, length, d)
        k = k.reshape(-1, k.shape[-3], k.shape[-2], d)
        if k.shape[1] != heads:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
        s = d ** -0.5 if scale is None else scale
        causal = (torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril()
                  if is_causal else None)
        mask = attn_mask
        if mask is not None:
            mask = mask.reshape(-1, *mask.shape[-3:]) if mask.ndim >= 3 else mask
        step = max(1, _CHUNK // max(1, heads * length * k.shape[2]))
        out = torch.full((heads,), float("-inf"), device=q.device)
        for b in range(0, q.shape[0], step):
            scores = torch.matmul(q[b:b + step], k[b:b + step].transpose(-2, -1)).float() * s
            if causal is not None:
                scores.masked_fill_(~causal, float("-inf"))
            if mask is not None:
                m = mask[b:b + step] if mask.ndim == 4 and mask.shape[0] > 1 else mask
                scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
            out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
        return out


class _Observer(TorchFunctionMode):
    """Active during one attention module's forward: records what its attention op computes."""

    def __init__(self, site: Site):
        super().__init__()
        self.site = site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if torch.is_grad_enabled() and isinstance(first, torch.Tensor) and not first.is_meta:
            if func is _SDPA:
                self.site.observe(sdpa_head_max(*args, **kwargs))
            elif func in _SOFTMAX and first.ndim == 4 and first.shape[1] == self.site.heads:
                with torch.no_grad():
                    self.site.observe(first.detach().amax(dim=(0, 2, 3)))
        return func(*args, **kwargs)


def _inert(*args) -> None:
    """What a copied or unpickled model's monitor hook becomes: nothing (a copy is watched only by
    a monitor attached to it)."""


class _HookMethod:
    """A bound hook that copies and pickles as :func:`_inert`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce__(self):
        return (_inert_hook, ())


def _inert_hook():
    return _inert


class _Hook:
    """One site's forward pre-hook (enters an :class:`_Observer`) and forward hook (leaves it)."""

    def __init__(self, site: Site, monitor: "AttentionMonitor"):
        self.site = site
        self.monitor = monitor  # the model's hooks keep its monitor alive (the registry holds it weakly)
        self.modes: list = []
        self.enter = _HookMethod(self._enter)
        self.leave = _HookMethod(self._leave)

    def _enter(self, _mod, _args) -> None:
        mode = _Observer(self.site)
        mode.__enter__()
        self.modes.append((mode, self.site.observed))

    def _leave(self, _mod, _args, _out) -> None:
        if self.modes:
            mode, before = self.modes.pop()
            mode.__exit__(None, None, None)
            if self.site.observed == before and torch.is_grad_enabled():
                self.site.blind += 1  # a kernel the monitor cannot see (flash / flex attention)


class AttentionMonitor:
    """What :func:`monitor_attention` returns: the watched sites; :meth:`remove` detaches it."""

    def __init__(self, model: nn.Module):
        self.sites, self.refused = attention_sites(model)
        if not self.sites:
            why = "; ".join(f"{n}: {w}" for n, w in self.refused.items())
            raise ValueError("monitor_attention found no attention module with q_proj/k_proj, a fused c_attn or "
                             "multi-head latent attention's q_b_proj/kv_b_proj, and stated head counts, in this model"
                             + (f" ({why})" if why else ""))
        self._by_param = {id(p): (site, parts) for site in self.sites for p, parts in site.tensors.values()}
        self._handles: list = []
        for site in self.sites:
            hook = _Hook(site, self)
            self._handles.append(site.module.register_forward_pre_hook(hook.enter))
            self._handles.append(site.module.register_forward_hook(hook.leave, always_call=True))
        _ACTIVE.append(weakref.ref(self))

    def find(self, param: torch.Tensor) -> Optional[tuple[Site, list]]:
        """(site, parts) of a query/key tensor this monitor watches, else None."""
        return self._by_param.get(id(param))

    def maxima(self) -> dict[str, torch.Tensor]:
        """Per site (module name), the per-head maxima since the last clip (sites not yet seen left out)."""
        return {s.name: s.maxima for s in self.sites if s.maxima is not None}

    def reset(self) -> None:
        """Forget the maxima (and the forwards not seen) recorded so far."""
        for s in self.sites:
            s.maxima, s.blind = None, 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _ACTIVE[:] = [r for r in _ACTIVE if r() is not None and r() is not self]


#: the attached monitors, oldest first, held weakly (a model's hooks hold its monitor)
_ACTIVE: list[weakref.ref] = []


def _attached() -> list[AttentionMonitor]:
    live = [m for m in (r() for r in _ACTIVE) if m is not None]
    if len(live) != len(_ACTIVE):
        _ACTIVE[:] = [weakref.ref(m) for m in live]
    return live


def find_monitored(param: torch.Tensor) -> Optional[tuple[Site, list]]:
    """(site, parts) of ``param`` in the most recently attached monitor that watches it, else None."""
    for monitor in reversed(_attached()):
        found = monitor.find(param)
        if found is not None:
            return found
    return None


def watching_any() -> bool:
    """Whether any monitor is attached."""
    return bool(_attached())


def monitor_attention(model: nn.Module) -> AttentionMonitor:
    """Watch ``model``'s attention modules and keep each head's largest pre-softmax logit
    (max q·kᵀ·scale over the forwards since the last optimizer step), which a rule's ``qk_clip``
    reads after each step. Attach once, after building the model; ``.remove()`` detaches."""
    return AttentionMonitor(model)
