"""Roles inferred from a model's module tree: :func:`infer_roles` and the module rules it runs.

The registered module rules (norm, embedding, router, expert, head), in order, claim modules; each
parameter takes the claim on its owning module or nearest claimed ancestor, the role its own name
gives it, or ``hidden``/``other``. The module rules' docstrings are the documentation
(:mod:`geomopt.compile.roles` tells the whole story); what an ``auto`` view reads of each tensor is
:mod:`geomopt.compile.roles.structure`'s.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from geomopt.compile.match import ParamInfo
from geomopt.compile.roles.structure import tensor_structure
from geomopt.compile.roles.tree import ModuleTree
from geomopt.compile.roles.types import Claim, Role, not_a_matrix, own_role

# ---------------------------------------------------------------- module rules

ModuleRule = Callable[[ModuleTree], Iterable[tuple[str, Claim]]]
MODULE_RULES: list[tuple[str, ModuleRule]] = []


def module_rule(name: str):
    """Register a module rule: ``fn(model) -> (module name, Claim)`` pairs, tried in order."""

    def register(fn):
        MODULE_RULES.append((name, fn))
        return fn

    return register




@module_rule("norm")
def _norm_layers(m: ModuleTree):
    """``norm``: a module whose class (or a base class) is named ``…Norm`` or ``…Norm{1,2,3}d``
    (LayerNorm, RMSNorm, BatchNorm2d, GroupNorm, LlamaRMSNorm, T5LayerNorm …): all its
    parameters."""
    for name, mod in m.modules.items():
        if m.is_norm(mod):
            yield name, Claim("norm", f"{type(mod).__name__} is a norm layer")


@module_rule("embedding")
def _embeddings(m: ModuleTree):
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
            m.embeddings[kind] = next(
                (c for c in m.mro(mod) if c.endswith(("Embedding", "Embeddings", "EmbeddingBag"))), None)
        cls = m.embeddings[kind]
        if cls is not None:
            yield name, Claim("embedding", f"{type(mod).__name__} is an embedding"
                              + ("" if cls == type(mod).__name__ else f" ({cls})"))


def _experts(m: ModuleTree) -> list[tuple[str, str, int]]:
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
        import torch  # torch: off the lint path (a spec alone never loads it)

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
def _routers(m: ModuleTree):
    """``router``: beside an experts container with E experts (see ``expert``), a sibling layer
    whose weight has E outputs (the MoE gate: Mixtral's and Qwen2-MoE's ``gate``) or one output (a
    shared expert's scalar gate, Qwen2-MoE's ``shared_expert_gate``)."""
    for parent, container, count in _experts(m):
        for child in m.children.get(parent, []):
            if child == container:
                continue
            out = m.out_features(m.modules[child])
            if out is not None and out in (count, 1):
                what = (f"{count} outputs = the expert count of '{container}'" if out == count
                        else "one output (a scalar gate)")
                yield child, Claim("router", f"{type(m.modules[child]).__name__} beside experts '{container}' "
                                             f"with {what}")


@module_rule("expert")
def _expert_weights(m: ModuleTree):
    """``expert``: everything inside an experts container — a child named ``experts`` (or whose
    class is named ``…Experts``) that is a ModuleList, or holds parameters of ≥ 3 dims with a
    common leading size E. Batched expert weights (E, out, in) have the structure ``batch: 1`` (E
    matrices); a fused ``gate_up`` weight also ``blocks: 2`` (gate and up)."""
    for _, container, count in _experts(m):
        yield container, Claim("expert", f"inside experts container '{container}' ({count} experts)")


@module_rule("head")
def _heads(m: ModuleTree):
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
    for name, _ in heads:
        if name not in found:
            yield name, Claim("head", "last layer with a matrix weight (registration order)" if len(heads) == 1
                              else "one of two last layers reading the same features")


# ---------------------------------------------------------------- per tensor


def infer_roles(model, infos: list[ParamInfo], modules: Optional[dict] = None) -> dict[str, Role]:
    """Roles of ``infos`` (from :func:`~geomopt.compile.params.params_from_model`) inferred from
    ``model``'s structure (an ambiguous inference says so in its evidence; lint GO119 reports it).
    ``modules``: ``dict(model.named_modules(remove_duplicate=False))`` when the caller has it."""
    m = ModuleTree(model, modules)
    claims: dict[str, Claim] = {}
    for rule_name, rule in MODULE_RULES:
        if rule_name == "head":
            m.excluded = [n for n, c in claims.items() if c.role in ("norm", "embedding", "router", "expert")]
        for name, claimed in rule(m):
            claims.setdefault(name, claimed)
    out: dict[str, Role] = {}
    cache: dict[str, Optional[tuple[str, Claim]]] = {}

    def claim_of(module_name: str) -> Optional[tuple[str, Claim]]:
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
            elif own_role(pname, len(p.shape)):
                role, why = "bias", f"named {pname!r}"
            elif claim is not None:
                role, why = claim.role, claim.evidence
            else:
                flat = not_a_matrix(p.shape, mod) if len(p.shape) >= 2 else "a vector of the body"
                role, why = ("other", flat) if flat else ("hidden", "a matrix of the body")
            if role == "router" and len(p.shape) < 2:
                role = "bias"
            if role in roles:
                continue
            roles.append(role)
            evidence.append(why)
            if structure is None and mod is not None and len(p.shape) >= 2:
                structure = tensor_structure(m, name, mod, pname, p.shape, role)
        out[p.name] = Role(tuple(roles), "; ".join(evidence), False, structure)
    return out
