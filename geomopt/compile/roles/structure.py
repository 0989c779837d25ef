"""A tensor's structure: what an ``auto`` matrix view reads of it, found in the module tree.

``batch: 1`` for batched expert weights (E, out, in), the output-axis blocks of a fused projection
(q, k, v; gate, up), ``layout: in_out`` for experts stored transposed. Role inference
(:mod:`geomopt.compile.roles.infer`) records it on each tensor's role; :mod:`geomopt.geometry.view`
reads it.
"""

from __future__ import annotations

import functools
from typing import Optional

from geomopt.compile.roles.tree import ModuleTree


def stated_count(mod, *names: str) -> Optional[int]:
    """The first positive int among the attributes ``names`` of a module, then of its ``config``
    (how attention modules state their head counts: ``num_heads``, ``n_head``, …)."""
    cfg = getattr(mod, "config", None)
    for owner in (mod, cfg):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _head_counts(mod) -> Optional[tuple[int, int, Optional[int]]]:
    """(heads, key/value heads, head dim or None) from an attention module's attributes or config."""
    first = functools.partial(stated_count, mod)
    heads = first("num_heads", "num_attention_heads", "n_head", "n_heads")
    if heads is None:
        return None
    kv = first("num_key_value_heads", "num_kv_heads", "n_kv_heads") or heads
    return heads, kv, first("head_dim")


def _fused_blocks(m: ModuleTree, name: str, mod, pname: str, shape: tuple[int, ...]) -> Optional[list[int]]:
    """Output-axis block sizes of a fused projection, or None. ``nn.MultiheadAttention``'s
    ``in_proj_weight``: q, k, v of equal size; a layer of an attention module (a class named
    ``…Attention…``/``…Attn…`` that states its head counts — ``num_heads``/``n_head``,
    ``num_key_value_heads``, ``head_dim`` — itself or in its ``config``, and has two matrix layers:
    the fused projection and the output projection) whose outputs number (heads + 2·kv heads)·head
    dim: q, k, v (unequal under grouped-query attention; GPT-2's ``c_attn``, Phi-3's ``qkv_proj``).
    (Fused [gate, up] weights are :func:`tensor_structure`'s. Other modules may hold head
    counts too, e.g. a Hugging Face MLP holds the model's config: they say nothing of its layers.)"""
    if pname == "in_proj_weight" and "MultiheadAttention" in m.mro(mod) and len(shape) == 2 and shape[0] % 3 == 0:
        return [shape[0] // 3] * 3
    parent = m.modules.get(name.rpartition(".")[0])
    if parent is None or len(shape) != 2:
        return None
    if not any("Attention" in c or "Attn" in c for c in m.mro(parent)):
        return None
    layers = [c for c in m.children.get(name.rpartition(".")[0], []) if m.weight(m.modules[c]) is not None]
    if len(layers) != 2:  # a fused q, k, v projection and the output projection, nothing else
        return None
    counts = _head_counts(parent)
    if counts is None:
        return None
    heads, kv, head_dim = counts
    conv1d = "Conv1D" in m.mro(mod)
    out, d_in = (shape[1], shape[0]) if conv1d else (shape[0], shape[1])
    head_dim = head_dim or (d_in // heads if d_in % heads == 0 else None)
    if head_dim is None or out != (heads + 2 * kv) * head_dim or out == heads * head_dim:
        return None
    return [heads * head_dim, kv * head_dim, kv * head_dim]


def tensor_structure(m: ModuleTree, name: str, mod, pname: str, shape: tuple[int, ...], role: str) -> Optional[dict]:
    """What an ``auto`` view reads: ``batch: 1`` for batched expert weights; ``layout: in_out`` where
    the experts module says its weights are stored (E, in, out) (``is_transposed``, GPT-OSS); the
    output-axis blocks of a fused projection. A fused [gate, up] weight is cut in two only where it
    is concatenated (Hugging Face's ``is_concatenated``, or no such flag) and stored (out, in):
    GPT-OSS interleaves gate and up columns, which no block view reads."""
    batch = 1 if role == "expert" and len(shape) >= 3 else 0
    transposed = bool(batch and getattr(mod, "is_transposed", False))
    blocks: Optional[int | list[int]] = None
    if "gate_up" in pname or "gate_up" in name.rpartition(".")[0].rpartition(".")[2]:
        rows = shape[batch]
        concatenated = getattr(mod, "is_concatenated", True)
        blocks = 2 if rows % 2 == 0 and concatenated and not transposed else None
    elif role in ("hidden", "expert"):
        blocks = _fused_blocks(m, name.rpartition(".")[0], mod, pname, shape)
    if not batch and blocks is None:
        return None
    out: dict = {"batch": batch}
    if blocks is not None:
        out["blocks"] = blocks
    if transposed:
        out["layout"] = "in_out"
    return out
