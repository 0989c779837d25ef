"""Roles from names and shapes alone: :func:`guess_roles`, for a checkpoint or (name, tensor) pairs.

Every role found this way is marked as a guess; :mod:`geomopt.compile.roles` tells the whole story.
"""

from __future__ import annotations

import re

from geomopt.compile.match import ParamInfo
from geomopt.compile.roles.types import Role, not_a_matrix, own_role

_EMBED = re.compile(r"embed|(^|_)emb(_|$)|^wte$|^wpe$|^shared$|^relative_attention_bias$|^cls_token$|^pos_embed"
                    r"|^mask_token$|^position_embeddings$")
_NORMISH = re.compile(r"norm|^ln(_|\d|$)|_ln$|^bn\d*$|layernorm")
_HEADS = ("lm_head", "head", "classifier", "score", "output", "fc", "logits")
_DIGITS = re.compile(r"\.\d+(?=\.)")


def guess_roles(infos: list[ParamInfo]) -> dict[str, Role]:
    """Roles from names and shapes only (a checkpoint), each marked as a guess:

    * ``norm``: < 2 dims and a name part like ``norm``, ``ln_1``, ``layernorm``, ``bn1``;
    * ``bias``: the last name part is ``bias``, ends in ``_bias`` or is an RNN's ``bias_ih_l0``;
    * ``embedding``: a name part containing ``embed`` or ``emb``, or ``wte``, ``wpe``, ``shared``,
      ``relative_attention_bias``, ``cls_token``, ``pos_embed…``, ``position_embeddings``;
    * ``expert``: a name part ``experts`` (≥ 3 dims: ``batch: 1``; ``gate_up``: two blocks);
    * ``router``: a 2-D ``gate`` / ``router`` / ``*_gate`` weight in a block that has experts, with
      the expert count or one output rows;
    * ``head``: outside the numbered blocks, a top-level ``lm_head``, ``head``, ``classifier``,
      ``score``, ``output``, ``fc`` or ``logits`` weight, any ``lm_head``/``classifier`` weight, or
      a non-embedding 2-D weight with an embedding's shape (vocabulary × width);
    * ``other``: a single row or column (``1×n``, ``n×1``: a vector);
    * else ``hidden`` (≥ 2 dims) or ``other``.
    """
    expert_counts: dict[str, int] = {}  # block prefix → expert count
    embed_shapes = set()
    for p in infos:
        parts = p.name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            prefix = ".".join(parts[:i])
            if len(p.shape) >= 3:
                expert_counts[prefix] = p.shape[0]
            elif i + 1 < len(parts) and parts[i + 1].isdigit():
                expert_counts[prefix] = max(expert_counts.get(prefix, 0), int(parts[i + 1]) + 1)
        elif len(p.shape) == 2 and any(_EMBED.search(s) for s in parts[:-1]):
            embed_shapes.add(p.shape)
    cache: dict = {}
    out = {}
    for p in infos:
        key = (_DIGITS.sub(".#", p.name), p.shape)
        role = cache.get(key)
        if role is None:
            role = cache[key] = _guess(p, expert_counts, embed_shapes)
        out[p.name] = role
    return out


def _guess(p: ParamInfo, experts: dict[str, int], embed_shapes: set) -> Role:
    parts = p.name.split(".")
    last, ndim = parts[-1], len(p.shape)
    mods = parts[:-1]
    outside_layers = not any(s.isdigit() for s in mods)  # heads sit outside the numbered blocks
    structure = None
    if ndim < 2 and any(_NORMISH.search(s.lower()) for s in mods):
        role, why = "norm", "a vector under a norm-like name"
    elif own_role(last, ndim):
        role, why = "bias", f"named {last!r}"
    elif any(_EMBED.search(s) for s in parts):
        role, why = "embedding", "an embedding-like name"
    elif "experts" in parts:
        role, why = "expert", "under 'experts'"
        batch = 1 if ndim >= 3 else 0
        structure = {"batch": batch} if batch else None
        if "gate_up" in p.name and ndim >= 2 and p.shape[batch] % 2 == 0:
            structure = {"batch": batch, "blocks": 2}
    elif (ndim == 2 and mods and (mods[-1] in ("gate", "router") or mods[-1].endswith("_gate"))
          and ".".join(mods[:-1]) in experts and p.shape[0] in (experts[".".join(mods[:-1])], 1)):
        role, why = "router", "a gate beside experts"
    elif ndim >= 2 and outside_layers and ((len(mods) == 1 and mods[0] in _HEADS) or "lm_head" in mods
                                           or "classifier" in mods):
        role, why = "head", "an output-layer name"
    elif ndim == 2 and outside_layers and p.shape in embed_shapes:
        role, why = "head", "an embedding's shape (vocabulary × width)"
    elif ndim < 2:
        role, why = ("norm", "a vector weight") if last == "weight" else ("other", "a vector")
    elif (flat := not_a_matrix(p.shape)) is not None:
        role, why = "other", flat
    else:
        role, why = "hidden", "a matrix"
        if ndim == 2 and "gate_up" in last + (mods[-1] if mods else "") and p.shape[0] % 2 == 0:
            structure = {"batch": 0, "blocks": 2}
    return Role((role,), why + " (guessed from names and shapes)", True, structure, basis="names")
