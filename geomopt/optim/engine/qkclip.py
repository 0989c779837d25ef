"""QK-clip after a step (a rule's ``qk_clip: {kind: max_logit, tau, alpha}``).

Kimi K2 (arXiv 2507.20534 §2.1, MuonClip): with S_h the largest pre-softmax logit of head h over
the step's forwards (:mod:`geomopt.monitor`), η_h = min(1, τ / S_h), and after the optimizer's
update::

    W_q^h ← η_h^α · W_q^h        W_k^h ← η_h^(1−α) · W_k^h        (α = 0.5 in the report)

so q_h·k_h, hence S_h, scales by η_h: a head above τ lands on τ, the others are untouched. A
projection's bias (GPT-2's ``c_attn``) is scaled with its rows, so the whole q (k) of the head
scales. Under grouped-query attention a key head serves several query heads; it takes the
smallest η of its group, η_g^(1−α), which still brings every head of the group to at most τ
(η_g ≤ η_h: S_h⁺ = η_h^α η_g^(1−α) S_h ≤ τ), and clips the others of the group somewhat more.

Multi-head latent attention (the report's own model): head h's logit is q_C^h·k_C^h + q_R^h·k_R
with the rotary key k_R shared by every head, so only the per-head parts are scaled (the report's
rule, there with α = 0.5)::

    q_C^h ← η_h^α · q_C^h        k_C^h ← η_h^(1−α) · k_C^h        q_R^h ← η_h · q_R^h        k_R unchanged

and both terms, hence S_h, scale by η_h. The rows are head h's of ``q_b_proj`` and ``kv_b_proj``
(:func:`geomopt.monitor._mla_site`); their value rows and the shared ``kv_a_proj_with_mqa`` and
``q_a_proj`` are never written, and a QK-clip rule that owns a shared tensor is refused.

The checks come before anything is written: at construction (the rule's tensors must be query/key
projections of attention modules the model has, and every projection weight of a clipped module
must be in a QK-clip rule with the same settings) and at the start of each step (a monitor must be
attached). Under ``torch.distributed`` the maxima are all-reduced (max) before use; sharded
(DTensor) parameters are refused.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from geomopt.distributed.executors import LocalExecutor, is_dtensor
from geomopt.monitor import Site, attention_sites, find_monitored, watching_any
from geomopt.spec.diagnostics import Diagnostic, SpecError
from geomopt.spec.validate import source_of

__all__ = ["QKClip", "clip_site"]

_ATTACH = ("attach the attention monitor once after building the model, before the first forward: "
           "`handle = geomopt.monitor_attention(model)` (handle.remove() detaches it)")


def clip_site(site: Site, maxima: torch.Tensor, tau: float, alpha: float) -> None:
    """Scale ``site``'s query/key tensors in place for per-head maxima ``maxima`` (heads,): with
    η_h = τ / max(S_h, τ), query head h's rows (and bias entries) × η_h^α, key head j's ×
    (min over its query heads η_h)^(1−α) (Kimi K2, arXiv 2507.20534 §2.1, grouped keys as above),
    MLA's per-head rotary query rows × η_h; computed in float32 and written in the tensor's dtype
    (only the rows of its parts: value rows and head-shared tensors are not touched)."""
    eta = torch.nan_to_num(tau / maxima.float().clamp_min(tau), nan=1.0)  # a NaN logit clips nothing
    group = site.heads // site.kv_heads
    scales = {"q": eta.pow(alpha), "k": eta.view(site.kv_heads, group).amin(dim=1).pow(1.0 - alpha), "q_rope": eta}
    with torch.no_grad():
        for p, parts in site.tensors.values():
            for part in parts:
                block = part.block(p)
                shape = [1] * block.ndim
                shape[part.axis] = -1
                block.copy_(block.float() * scales[part.kind].to(block.device).view(shape))


def _checked_sites(entries: list, sites: list, refused: dict) -> list:
    """[(site, clip)] for the rule tensors ``entries`` [(param, name, rule, clip)], or ValueError."""
    by_param = {id(p): site for site in sites for p, _ in site.tensors.values()}
    shared = {n: (site, what) for site in sites for n, what in site.shared.items()}
    chosen: dict = {}
    for p, name, rule, clip in entries:
        site = by_param.get(id(p))
        if site is None and name in shared:
            site, what = shared[name]
            raise ValueError(
                f"rule '{rule}' has qk_clip, but tensor '{name}' gives {what}, shared by every head of the multi-head "
                f"latent attention module '{site.name}': QK-clip scales only the per-head parts (q_C, q_R, k_C: "
                f"{' and '.join(map(repr, site.weights))}) and leaves the shared ones as they are; narrow the rule's "
                f"match to those, e.g. \"re:.*\\.(q_b_proj|kv_b_proj)\\.weight\"")
        if site is None:
            owner = name.rpartition(".")[0]
            why = next((f" (module '{m}' is {w})" for m, w in refused.items() if owner.startswith(m + ".") or
                        owner == m), "")
            raise ValueError(
                f"rule '{rule}' has qk_clip, but tensor '{name}' is not a query or key projection of an attention "
                f"module{why}: QK-clip rescales q/k projections per head (q_proj/k_proj, a fused c_attn with "
                f"stated head counts, or MLA's q_b_proj/kv_b_proj); narrow the rule's match to those tensors, e.g. "
                f"\"re:.*\\.(q_proj|k_proj)\\.weight\"")
        if chosen.setdefault(site.name, (site, clip, rule))[1] != clip:
            raise ValueError(f"attention module '{site.name}': its query/key tensors are in rules with different "
                             f"qk_clip settings ('{chosen[site.name][2]}', '{rule}'); one module clips as one")
    covered = {name for _, name, _, _ in entries}
    for site, _, rule in chosen.values():
        missing = [w for w in site.weights if w not in covered]
        if missing:
            raise ValueError(f"rule '{rule}' clips attention module '{site.name}', but its projection "
                             f"{', '.join(map(repr, missing))} is in no rule with the same qk_clip: QK-clip scales "
                             f"queries and keys together, so match both")
    return [(site, clip) for site, clip, _ in chosen.values()]


def _refusal(spec, index: int, message: str) -> SpecError:
    """GO104 (a rule that cannot act on a tensor it owns) at the rule's ``qk_clip`` key."""
    source = source_of(spec) if spec is not None else None
    line, col = source.pos(("rules", index, "qk_clip")) if source else (1, 1)
    return SpecError([Diagnostic("GO104", "inapplicable-geometry", "error", message,
                                 source.file if source else "<spec>", line, col)])


class QKClip:
    """The optimizer's QK-clip: built at construction (checks), :meth:`check` at the start of a step,
    :meth:`apply` after it."""

    def __init__(self, param_groups: list, plans: list, source, spec=None, executor=None) -> None:
        # the maxima are reduced over the optimizer's own process group (a DDP group, or the world);
        # one process (distributed=False, or no torch.distributed) reduces nothing
        self.reduce = executor is not None and not isinstance(executor, LocalExecutor)
        self.group = executor.group if self.reduce else None
        self.entries = [(p, pp.name, pp.rule, pp.qk_clip) for g, pps in zip(param_groups, plans)
                        for p, pp in zip(g["params"], pps) if pp.qk_clip is not None]
        where = {pp.rule: pp.rule_index for pps in plans for pp in pps if pp.qk_clip is not None}
        self._sites: Optional[list] = None  # [(monitor's site, clip)] once a step found them
        if not self.entries:
            return
        if any(is_dtensor(p) for p, _, _, _ in self.entries):
            raise NotImplementedError("qk_clip: sharded (DTensor) parameters are not supported; "
                                      "use it with local or DDP-replicated parameters")
        if isinstance(source, nn.Module):
            try:
                _checked_sites(self.entries, *attention_sites(source))
            except ValueError as exc:  # a spec that does not fit the model: where in the spec, and why
                rule = next((r for r in where if f"'{r}'" in str(exc)), next(iter(where)))
                raise _refusal(spec, where[rule], str(exc)) from None

    def check(self) -> None:
        """Before a step writes anything: every clipped tensor is watched by an attached monitor."""
        if not self.entries:
            return
        sites, unwatched = [], []
        for p, name, rule, _ in self.entries:
            found = find_monitored(p)
            if found is None:
                unwatched.append((name, rule))
            else:
                sites.append(found[0])
        if unwatched:
            name, rule = unwatched[0]
            more = f" (and {len(unwatched) - 1} more)" if len(unwatched) > 1 else ""
            if watching_any():  # a monitor is attached, to another model or not to this tensor's module
                raise RuntimeError(f"rule '{rule}' has qk_clip, but '{name}'{more} is not a query/key projection of "
                                   f"an attention module an attached monitor watches: attach "
                                   f"geomopt.monitor_attention to the model this optimizer steps, and keep the rule "
                                   f"to q/k projections. Nothing was written by this step")
            raise RuntimeError(f"rule '{rule}' has qk_clip, but no attention monitor watches '{name}'{more}: "
                               f"{_ATTACH}. Nothing was written by this step")
        self._sites = _checked_sites(self.entries, list({id(s): s for s in sites}.values()), {})
        blind = [s for s, _ in self._sites if s.blind]
        if blind:
            raise RuntimeError(
                f"attention module '{blind[0].name}' ran {blind[0].blind} training forward(s) in which the monitor saw "
                f"no attention op (neither F.scaled_dot_product_attention nor a softmax of the scores: a flash or "
                f"flex attention kernel, or a custom one), so QK-clip has no logits for it: use "
                f"attn_implementation='sdpa' or 'eager'. Nothing was written by this step")

    def apply(self) -> None:
        """After the step: clip each watched module whose heads exceeded τ, then forget its maxima."""
        if not self._sites:
            return
        if self.reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # every rank reduces every site (a site one rank has not seen yet is -inf there)
            device = next(p.device for p, _, _, _ in self.entries)
            flat = torch.cat([s.maxima.to(device) if s.maxima is not None
                              else torch.full((s.heads,), float("-inf"), device=device) for s, _ in self._sites])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
            for (s, _), m in zip(self._sites, flat.split([s.heads for s, _ in self._sites])):
                s.maxima = m
        seen = [(site, clip) for site, clip in self._sites if site.maxima is not None]
        for site, clip in seen:
            clip_site(site, site.maxima, clip["tau"], clip["alpha"])
        for site, _ in self._sites:
            site.maxima, site.blind = None, 0
