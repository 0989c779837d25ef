"""Roles: what each tensor does in its model, so one spec routes any architecture.

A role is one of ``embedding``, ``head``, ``router``, ``expert``, ``norm``, ``bias``, ``hidden``
(every other tensor with ≥ 2 dims) and ``other`` (every other tensor with < 2 dims). Rules match
it with ``match: {role: …}``. Each tensor also gets the **evidence** for its role, a **guessed**
flag (roles read from names and shapes only, as for a checkpoint) and a **structure** — what an
``auto`` matrix view reads (:mod:`geomopt.geometry.view`): ``{"batch": 1}`` for batched expert
weights (E, out, in), ``{"blocks": [...]}`` for fused projections (sizes along the output axis).

Inference from a model: every registered *module rule* below, in order, claims modules of the
model; a parameter takes the role of the first claim on its owning module or an ancestor (the
module rules' docstrings are the documentation). Then, per parameter: a norm module's parameters
are ``norm``; otherwise a parameter named ``bias`` (or ``*_bias``) is ``bias``; otherwise the
claim; otherwise ``hidden`` (≥ 2 dims) or ``other``. A tensor tied under several names has the
roles of each.

From names and shapes alone (a checkpoint, or a list of (name, tensor)): :func:`guess_roles`,
every role marked as a guess.

A spec's ``roles:`` (and ``roles=`` of the Python API) give tensors a role by name pattern, over
everything inferred.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Optional

from geomopt.compile.match import ParamInfo, any_name, glob_regex

ROLES = ("embedding", "head", "router", "expert", "norm", "bias", "hidden", "other")


@dataclasses.dataclass(frozen=True)
class Role:
    """The role(s) of one tensor and why."""

    roles: tuple[str, ...]
    evidence: str
    guessed: bool = False
    structure: Optional[dict] = None

    @property
    def name(self) -> str:
        return "+".join(self.roles)


@dataclasses.dataclass(frozen=True)
class Claim:
    role: str
    evidence: str
    structure: Optional[dict] = None


# ---------------------------------------------------------------- module rules

ModuleRule = Callable[["_Model"], Iterable[tuple[str, Claim]]]
MODULE_RULES: list[tuple[str, ModuleRule]] = []


def module_rule(name: str):
    """Register a module rule: ``fn(model) -> (module name, Claim)`` pairs, tried in order."""

    def register(fn):
        MODULE_RULES.append((name, fn))
        return fn

    return register


_NORM = re.compile(r"Norm(\dd)?$")


class _Model:
    """The module tree of a model, read once."""

    def __init__(self, model, modules: Optional[dict] = None):
        self.model = model
        self.modules: dict[str, object] = modules if modules is not None else dict(model.named_modules(remove_duplicate=False))
        self.classes: dict[type, tuple[str, ...]] = {}
        self.norms: dict[type, bool] = {}
        self.embeddings: dict[type, Optional[str]] = {}
        self.experts: Optional[list] = None
        self.excluded: list[str] = []  # modules the head rule skips (claimed as norm, embedding, router, expert)
        self.children: dict[str, list[str]] = {}
        for name in self.modules:
            if name:
                self.children.setdefault(name.rpartition(".")[0], []).append(name)

    def mro(self, module) -> tuple[str, ...]:
        cls = type(module)
        names = self.classes.get(cls)
        if names is None:
            names = self.classes[cls] = tuple(c.__name__ for c in cls.__mro__)
        return names

    def is_norm(self, module) -> bool:
        cls = type(module)
        hit = self.norms.get(cls)
        if hit is None:
            hit = self.norms[cls] = any(_NORM.search(n) for n in self.mro(module))
        return hit

    def weight(self, module):
        """A leaf layer's 2-D+ ``weight`` (Linear, Conv, Conv1D, a router's own weight), else None."""
        w = getattr(module, "weight", None)
        import torch

        return w if isinstance(w, torch.Tensor) and w.ndim >= 2 else None

    def out_features(self, module) -> Optional[int]:
        w = self.weight(module)
        if w is None:
            return None
        return w.shape[1] if "Conv1D" in self.mro(module) else w.shape[0]


@module_rule("norm")
def _norm_layers(m: _Model):
    """``norm``: a module whose class (or a base class) is named ``…Norm`` or ``…Norm{1,2,3}d``
    (LayerNorm, RMSNorm, BatchNorm2d, GroupNorm, LlamaRMSNorm, T5LayerNorm …): all its
    parameters."""
    for name, mod in m.modules.items():
        if m.is_norm(mod):
            yield name, Claim("norm", f"{type(mod).__name__} is a norm layer")


@module_rule("embedding")
def _embeddings(m: _Model):
    """``embedding``: an ``nn.Embedding`` (or subclass); the module Hugging Face's
    ``get_input_embeddings()`` returns (token embeddings; a ViT's patch embedding); any module whose
    class is named ``…Embedding`` or ``…Embeddings`` (BertEmbeddings, ViTEmbeddings: position
    embeddings, class tokens), with everything below it."""
    seen = set()
    get = getattr(m.model, "get_input_embeddings", None)
    if callable(get):
        try:
            mod = get()
        except (NotImplementedError, AttributeError):
            mod = None
        for name, candidate in m.modules.items():
            if mod is not None and candidate is mod:
                seen.add(name)
                yield name, Claim("embedding", "get_input_embeddings()")
    for name, mod in m.modules.items():
        if name in seen:
            continue
        kind = type(mod)
        if kind not in m.embeddings:
            m.embeddings[kind] = next((c for c in m.mro(mod) if c.endswith(("Embedding", "Embeddings", "EmbeddingBag"))), None)
        cls = m.embeddings[kind]
        if cls is not None:
            yield name, Claim("embedding", f"{type(mod).__name__} is an embedding" + ("" if cls == type(mod).__name__ else f" ({cls})"))


def _experts(m: _Model) -> list[tuple[str, str, int]]:
    """(parent, experts container, expert count E) for every MoE block: a child named ``experts``
    (or whose class is named ``…Experts``) that is a ModuleList (E = its length) or holds
    parameters of ≥ 3 dims with a common leading size (E)."""
    if m.experts is not None:
        return m.experts
    out = m.experts = []
    for name, mod in m.modules.items():
        attr = name.rpartition(".")[2]
        if not name or not (attr == "experts" or any(c.endswith("Experts") for c in m.mro(mod))):
            continue
        import torch

        if isinstance(mod, torch.nn.ModuleList):
            count = len(mod)
        else:
            leading = {p.shape[0] for p in mod.parameters(recurse=False) if p.ndim >= 3}
            if len(leading) != 1:
                continue
            count = leading.pop()
        out.append((name.rpartition(".")[0], name, count))
    return out


@module_rule("router")
def _routers(m: _Model):
    """``router``: beside an experts container with E experts (see ``expert``), a sibling layer
    whose weight has E outputs (the MoE gate: Mixtral's and Qwen2-MoE's ``gate``) or one output (a
    shared expert's scalar gate, Qwen2-MoE's ``shared_expert_gate``)."""
    for parent, container, count in _experts(m):
        for child in m.children.get(parent, []):
            if child == container:
                continue
            out = m.out_features(m.modules[child])
            if out is not None and out in (count, 1):
                what = f"{count} outputs = the expert count of '{container}'" if out == count else "one output (a scalar gate)"
                yield child, Claim("router", f"{type(m.modules[child]).__name__} beside experts '{container}' with {what}")


@module_rule("expert")
def _expert_weights(m: _Model):
    """``expert``: everything inside an experts container — a child named ``experts`` (or whose
    class is named ``…Experts``) that is a ModuleList, or holds parameters of ≥ 3 dims with a
    common leading size E. Batched expert weights (E, out, in) have the structure ``batch: 1`` (E
    matrices); a fused ``gate_up`` weight also ``blocks: 2`` (gate and up)."""
    for _, container, count in _experts(m):
        yield container, Claim("expert", f"inside experts container '{container}' ({count} experts)")


@module_rule("head")
def _heads(m: _Model):
    """``head``: the layer(s) producing the model's outputs. The module Hugging Face's
    ``get_output_embeddings()`` returns (LM heads), and the last layer with a matrix weight in
    registration order that is not a norm, embedding, router or expert (a classifier, ``score``,
    ResNet's ``fc``). Two last layers side by side that read the same features (same parent, same
    input size, registered last) are both heads, with a note naming them."""
    found = set()
    get = getattr(m.model, "get_output_embeddings", None)
    target = None
    if callable(get):
        try:
            target = get()
        except (NotImplementedError, AttributeError):
            target = None
    if target is not None:
        for name, mod in m.modules.items():
            if mod is target:
                found.add(name)
                yield name, Claim("head", "get_output_embeddings()")
    excluded = set(m.excluded)

    def inside_excluded(name: str) -> bool:
        while name:
            if name in excluded:
                return True
            name = name.rpartition(".")[0]
        return False

    layers = [(n, mod) for n, mod in m.modules.items()
              if "weight" in mod._parameters and m.weight(mod) is not None and not inside_excluded(n)]
    if not layers:
        return
    last_name, last = layers[-1]
    heads = [(last_name, last)]
    if len(layers) > 1:
        prev_name, prev = layers[-2]
        same_parent = prev_name.rpartition(".")[0] == last_name.rpartition(".")[0]
        w_last, w_prev = m.weight(last), m.weight(prev)
        d_in = lambda mod, w: w.shape[0] if "Conv1D" in m.mro(mod) else w.shape[1]  # noqa: E731
        if same_parent and d_in(last, w_last) == d_in(prev, w_prev) and d_in(last, w_last) != m.out_features(prev):
            heads.insert(0, (prev_name, prev))
    for name, mod in heads:
        if name not in found:
            yield name, Claim("head", "last layer with a matrix weight (registration order)" if len(heads) == 1
                              else "one of two last layers reading the same features")


# ---------------------------------------------------------------- structure: fused projections


def _head_counts(mod) -> Optional[tuple[int, int, Optional[int]]]:
    """(heads, key/value heads, head dim or None) from an attention module's attributes or config."""
    cfg = getattr(mod, "config", None)

    def first(*names):
        for owner in (mod, cfg):
            for n in names:
                v = getattr(owner, n, None) if owner is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return None

    heads = first("num_heads", "num_attention_heads", "n_head", "n_heads")
    if heads is None:
        return None
    kv = first("num_key_value_heads", "num_kv_heads", "n_kv_heads") or heads
    return heads, kv, first("head_dim")


def _fused_blocks(m: _Model, name: str, mod, pname: str, shape: tuple[int, ...]) -> Optional[list[int]]:
    """Output-axis block sizes of a fused projection, or None. ``nn.MultiheadAttention``'s
    ``in_proj_weight``: q, k, v of equal size; a layer of an attention module (a class named
    ``…Attention…``/``…Attn…`` that states its head counts — ``num_heads``/``n_head``,
    ``num_key_value_heads``, ``head_dim`` — itself or in its ``config``, and has two matrix layers:
    the fused projection and the output projection) whose outputs number (heads + 2·kv heads)·head
    dim: q, k, v (unequal under grouped-query attention; GPT-2's ``c_attn``, Phi-3's ``qkv_proj``).
    (Fused [gate, up] weights are :func:`_structure`'s. Other modules may hold head
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


# ---------------------------------------------------------------- per tensor


def _own_role(pname: str, ndim: int) -> Optional[str]:
    return "bias" if (pname == "bias" or pname.endswith("_bias")) and ndim <= 2 else None


def infer_roles(model, infos: list[ParamInfo], modules: Optional[dict] = None) -> dict[str, Role]:
    """Roles of ``infos`` (from :func:`~geomopt.compile.params.params_from_model`) inferred from
    ``model``'s structure (an ambiguous inference says so in its evidence; lint GO119 reports it).
    ``modules``: ``dict(model.named_modules(remove_duplicate=False))`` when the caller has it."""
    m = _Model(model, modules)
    claims: dict[str, Claim] = {}
    for rule_name, rule in MODULE_RULES:
        if rule_name == "head":
            m.excluded = [n for n, c in claims.items() if c.role in ("norm", "embedding", "router", "expert")]
        for name, claim in rule(m):
            claims.setdefault(name, claim)
    out: dict[str, Role] = {}
    cache: dict[str, Optional[tuple[str, Claim]]] = {}

    def claim_of(module_name: str):
        """The first claim on this module or its nearest claimed ancestor."""
        if module_name in cache:
            return cache[module_name]
        hit = (module_name, claims[module_name]) if module_name in claims else None
        if hit is None and module_name:
            hit = claim_of(module_name.rpartition(".")[0])
        cache[module_name] = hit
        return hit

    for p in infos:
        roles, evidence, structure = [], [], None
        for name in (p.name, *p.aliases):
            owner, _, pname = name.rpartition(".")
            hit = claim_of(owner)
            claim = hit[1] if hit else None
            mod = m.modules.get(owner)
            if claim is not None and claim.role == "norm":
                role, why = "norm", claim.evidence
            elif _own_role(pname, len(p.shape)):
                role, why = "bias", f"named {pname!r}"
            elif claim is not None:
                role, why = claim.role, claim.evidence
            else:
                role, why = ("hidden", "a matrix of the body") if len(p.shape) >= 2 else ("other", "a vector of the body")
            if role == "router" and len(p.shape) < 2:
                role = "bias"
            if role in roles:
                continue
            roles.append(role)
            evidence.append(why)
            if structure is None and mod is not None and len(p.shape) >= 2:
                structure = _structure(m, name, mod, pname, p.shape, role)
        out[p.name] = Role(tuple(roles), "; ".join(evidence), False, structure)
    return out


def _structure(m: _Model, name: str, mod, pname: str, shape: tuple[int, ...], role: str) -> Optional[dict]:
    """What an ``auto`` view reads: ``batch: 1`` for batched expert weights; ``layout: in_out`` where
    the experts module says its weights are stored (E, in, out) (``is_transposed``, GPT-OSS); the
    output-axis blocks of a fused projection. A fused [gate, up] weight is cut in two only where it
    is concatenated (Hugging Face's ``is_concatenated``, or no such flag) and stored (out, in):
    GPT-OSS interleaves gate and up columns, which no block view reads."""
    batch = 1 if role == "expert" and len(shape) >= 3 else 0
    transposed = bool(batch and getattr(mod, "is_transposed", False))
    blocks = None
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


# ---------------------------------------------------------------- names and shapes only

_EMBED = re.compile(r"embed|(^|_)emb(_|$)|^wte$|^wpe$|^shared$|^relative_attention_bias$|^cls_token$|^pos_embed|^mask_token$|^position_embeddings$")
_NORMISH = re.compile(r"norm|^ln(_|\d|$)|_ln$|^bn\d*$|layernorm")
_HEADS = ("lm_head", "head", "classifier", "score", "output", "fc", "logits")
_DIGITS = re.compile(r"\.\d+(?=\.)")


def guess_roles(infos: list[ParamInfo]) -> dict[str, Role]:
    """Roles from names and shapes only (a checkpoint), each marked as a guess:

    * ``norm``: < 2 dims and a name part like ``norm``, ``ln_1``, ``layernorm``, ``bn1``;
    * ``bias``: the last name part is ``bias`` or ends in ``_bias``;
    * ``embedding``: a name part containing ``embed`` or ``emb``, or ``wte``, ``wpe``, ``shared``,
      ``relative_attention_bias``, ``cls_token``, ``pos_embed…``, ``position_embeddings``;
    * ``expert``: a name part ``experts`` (≥ 3 dims: ``batch: 1``; ``gate_up``: two blocks);
    * ``router``: a 2-D ``gate`` / ``router`` / ``*_gate`` weight in a block that has experts, with
      the expert count or one output rows;
    * ``head``: outside the numbered blocks, a top-level ``lm_head``, ``head``, ``classifier``,
      ``score``, ``output``, ``fc`` or ``logits`` weight, any ``lm_head``/``classifier`` weight, or
      a non-embedding 2-D weight with an embedding's shape (vocabulary × width);
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
    elif _own_role(last, ndim):
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
    else:
        role, why = "hidden", "a matrix"
        if ndim == 2 and "gate_up" in last + (mods[-1] if mods else "") and p.shape[0] % 2 == 0:
            structure = {"batch": 0, "blocks": 2}
    return Role((role,), why + " (guessed from names and shapes)", True, structure)


# ---------------------------------------------------------------- overrides and assignment


def override(roles: dict[str, Role], infos: list[ParamInfo], patterns: dict[str, list[str]], where: str) -> None:
    """Give the tensors matching ``patterns`` (role → name patterns, glob or ``re:``) that role,
    in place; ``where`` names the source in the evidence."""
    for role, pats in patterns.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        for pat in pats:
            fm = glob_regex(pat).fullmatch
            for p in infos:
                if any_name(fm, p):
                    old = roles.get(p.name)
                    roles[p.name] = Role((role,), f"{where}: {pat!r}", False, old.structure if old else None)


def assign(infos: list[ParamInfo], roles: dict[str, Role]) -> None:
    """Store each tensor's role on its :class:`ParamInfo` (in place: infos are plain records)."""
    for p in infos:
        object.__setattr__(p, "role", roles.get(p.name))


def ensure_roles(infos: list[ParamInfo], spec_roles: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    """Give every tensor without a role a guessed one, then apply the spec's ``roles:`` and the
    caller's ``roles=`` (in that order: the caller wins)."""
    missing = [p for p in infos if p.role is None]
    if not missing and not spec_roles and not extra:
        return  # roles inferred from the model, nothing to add
    roles = {p.name: p.role for p in infos if p.role is not None}
    if missing:
        roles.update(guess_roles(missing))
    if spec_roles:
        override(roles, infos, spec_roles, "spec roles")
    if extra:
        override(roles, infos, extra, "roles=")
    assign(infos, roles)


def role_docs() -> str:
    """The inference rules, for ``geomopt rule roles``."""
    parts = [__doc__.strip(), "Module rules, in order:"]
    for name, fn in MODULE_RULES:
        parts.append("  " + " ".join((fn.__doc__ or "").split()))
    parts.append("From names and shapes:\n" + "\n".join("  " + line.strip() for line in
                                                         (guess_roles.__doc__ or "").strip().splitlines()[1:]))
    return "\n\n".join(parts) + "\n"
