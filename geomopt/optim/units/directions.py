"""Direction estimators d (paper Section 4), each a declared unit
(:class:`~geomopt.optim.units.declare.DirectionUnit`: its spec model, state, forms and refusals, in its
``@direction`` line), and each rule's arithmetic written once: :func:`polyak_lerp` and
:func:`polyak_lookahead`, :func:`heavy_ball_update` and :func:`heavy_ball_lookahead` are the
formulas that every form calls (a tensor, a stacked bucket, rows of it, lists of tensors over a
flat block, a write put off behind a deferred finiteness test).

Each is ``fn(g, state, group, *, g_prev=None, inplace=False, fresh=None) -> d`` and updates
``state`` in place; given a list ``fresh``, it leaves the optimizer's state as it is until the
bucket commits (:mod:`geomopt.optim.engine.atomic`: an exception before then leaves the state as it
was): new tensors replace the old in ``state`` (a bucket's gathered dict, bound to the state when
the bucket commits), or, where d does not read the update (Lion), the in-place update is appended
to ``fresh`` and runs at the commit, which costs no memory. The same arithmetic, so the same bits.
``group`` is the param group: every coefficient (``alpha``, ``nesterov``, ``init``, heavy ball's
``momentum`` and ``dampening``, Lion's ``beta1`` and ``beta2``) is read from it, so what torch-style
schedulers and users edit is what the step uses; ``inplace`` says ``g`` is the caller's scratch
copy, which the function may overwrite.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from geomopt.optim.engine.tensors import stack
from geomopt.optim.units.declare import FIRST, OWN, PARAM, DirectionUnit, StateKey, declare
from geomopt.registry import OWNER, Registry
from geomopt.spec.updates import Dion, HeavyBall, Lion, NoDirection, Polyak, Storm

#: name → :class:`~geomopt.optim.units.declare.DirectionUnit`
DIRECTIONS = Registry("direction")
#: the momentum every direction with state keeps (stacked per bucket, in the operators' layout)
MOMENTUM = StateKey("d", moment=FIRST)


def direction(name: str, spec, *, state: tuple = (), migrates: Optional[str] = None, foreach=None, lookahead=None,
              rows: bool = False, weighted: bool = False, refuses: tuple = (), locality: Optional[str] = None):
    """Register ``fn`` as the direction ``name`` (:class:`~geomopt.optim.units.declare.DirectionUnit`):
    its spec model, its state (declared under the state kind ``migrates``), its list form
    ``foreach(ds, gs, group, first)`` (d in place over lists of tensors; gives the ``flat`` form)
    and ``lookahead(u, d, group)`` (Nesterov's u from u = g, in place), whether it has the ``rows``
    and ``weighted`` forms, and the forms it refuses with why."""

    def register(fn):
        declare(migrates, *state)
        forms = ("flat",) * (foreach is not None) + ("rows",) * rows + ("weighted",) * weighted
        unit = DirectionUnit(name, fn, spec, tuple(state), migrates, forms, tuple(refuses),
                             **({} if locality is None else {"locality": locality}))
        DIRECTIONS.add(name, unit, foreach=foreach, lookahead=lookahead)
        return fn

    return register


# ---------------------------------------------------------------- the arithmetic, once per rule


def polyak_lerp(d, g, alpha, out=None):
    """Polyak's d ← d + α(g − d) = d.lerp(g, α) (Theorem 4.3), the one place it is written: on a
    tensor (into ``out``, else d in place) or on lists of tensors (one foreach launch, in place)."""
    if isinstance(d, list):
        if torch.is_tensor(alpha):  # a device weight (a capturable step's α·ok): per tensor, no host read
            for a, b in zip(d, g):
                a.lerp_(b, alpha)
        else:
            torch._foreach_lerp_(d, g, alpha)
        return d
    return d.lerp_(g, alpha) if out is None else torch.lerp(d, g, alpha, out=out)


def polyak_lookahead(g, d, alpha, out=None):
    """Nesterov's look-ahead u = g + (1 − α)(d − g) = g.lerp(d, 1 − α), as torch.optim.Muon: into
    ``out`` (which may be g), else a new tensor."""
    return torch.lerp(g, d, 1 - alpha) if out is None else torch.lerp(g, d, 1 - alpha, out=out)


def polyak_ahead_weight(alpha, nesterov: bool):
    """The weight w of u = d.lerp(g, w) read from the old d: α without Nesterov (u = d⁺); with it
    g.lerp(d.lerp(g, α), 1 − α) = g + (1 − α)²(d − g), so w = 1 − (1 − α)² (α a number, or a
    capturable step's 0-d α·flag)."""
    return 1 - (1 - alpha) ** 2 if nesterov else alpha


def heavy_ball_update(b, g, group: dict, fresh: bool = False):
    """torch.optim.SGD's b ← μb + (1 − τ)g (μ = ``momentum``, τ = ``dampening``), its op order
    (mul, then add): on a tensor (``fresh``: into a new one) or on lists (in place)."""
    mu, tau = group["momentum"], group["dampening"]
    if isinstance(b, list):
        torch._foreach_mul_(b, mu)
        torch._foreach_add_(b, g, alpha=1 - tau)
        return b
    kept = torch.mul(b, mu) if fresh else b.mul_(mu)
    return kept.add_(g, alpha=1 - tau)


def heavy_ball_lookahead(g, b, group: dict, out=None):
    """torch.optim.SGD's Nesterov u = g + μb: in place over g where ``out`` is given (it is g), else
    a new tensor."""
    return torch.add(g, b, alpha=group["momentum"]) if out is None else g.add_(b, alpha=group["momentum"])


def _starts(update: Callable, at_gradient: Callable[[dict], bool]) -> Callable:
    """A list form ``foreach(ds, gs, group, first)``: on a first step (``first``: the state is new,
    zero) d⁰ = g⁰ where ``at_gradient(group)``, else ``update(ds, gs, group)`` (Nesterov's u =
    g.lerp(g, ·) = g on a first d⁰ = g⁰ is g, bit for bit)."""

    def foreach(ds: list, gs: list, group: dict, first: bool) -> None:
        if first and at_gradient(group):
            torch._foreach_copy_(ds, gs)
        else:
            update(ds, gs, group)

    return foreach


# ---------------------------------------------------------------- the registered directions


@direction("none", NoDirection, foreach=lambda ds, gs, group, first: None, weighted=True)
def plain(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """d = g."""
    return g


@direction("polyak", Polyak, state=(MOMENTUM,), migrates="momentum", rows=True, weighted=True,
           foreach=_starts(lambda ds, gs, group: polyak_lerp(ds, gs, group["alpha"]),
                           lambda group: group["init"] == "gradient"),
           lookahead=lambda u, d, group: polyak_lookahead(u, d, group["alpha"], out=u))
def polyak(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """Polyak momentum d ← αg + (1−α)d (Theorem 4.3; β = 1 − α in torch.optim.Muon's terms).

    d starts at zero as in torch.optim.Muon and Scion (``init: zero``), or at g⁰ as in the paper
    (``init: gradient``). With ``nesterov`` the step uses g + (1−α)(d − g) = g.lerp(d, 1−α), as
    torch.optim.Muon does.
    """
    alpha = group["alpha"]
    buf = state.get("d")
    if buf is None:
        buf = state["d"] = g.clone() if group["init"] == "gradient" else torch.zeros_like(g)
        if group["init"] == "gradient":
            return polyak_lookahead(g, buf, alpha) if group["nesterov"] else buf
    if fresh is not None:
        buf = state["d"] = polyak_lerp(buf, g, alpha, out=torch.empty_like(buf))
    else:
        polyak_lerp(buf, g, alpha)
    if not group["nesterov"]:
        return buf
    return polyak_lookahead(g, buf, alpha, out=g if inplace else None)


@direction("heavy_ball", HeavyBall, state=(MOMENTUM,), foreach=_starts(heavy_ball_update, lambda group: True),
           lookahead=lambda u, d, group: heavy_ball_lookahead(u, d, group, out=u))
def heavy_ball(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """Heavy-ball momentum as torch.optim.SGD runs it (Polyak 1964; Sutskever et al. 2013 for
    Nesterov): b⁰ = g⁰, then b ← μb + (1−τ)g; d = b, or d = g + μb with ``nesterov`` (τ =
    ``dampening``). Same op order as torch's single-tensor SGD, so the same bits. Its b is a sum,
    not an average of gradients: it is not carried across a spec change (no state kind)."""
    buf = state.get("d")
    if buf is None:
        buf = state["d"] = g.clone()
    else:
        buf = state["d"] = heavy_ball_update(buf, g, group, fresh=fresh is not None)
    if not group["nesterov"]:
        return buf
    return heavy_ball_lookahead(g, buf, group, out=g if inplace else None)


@direction("lion", Lion, state=(MOMENTUM,), migrates="momentum")
def lion(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """Lion's interpolation (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
    Algorithm 2): d = β₁m + (1−β₁)g, then m ← β₂m + (1−β₂)g, m⁰ = 0; the sign is the geometry's
    (anisotropic, indicator reference). lion-pytorch's op order (mul, add), so the same bits."""
    beta1, beta2 = group["beta1"], group["beta2"]
    m = state.get("d")
    if m is None:
        m = state["d"] = torch.zeros_like(g)
    d = torch.mul(m, beta1).add_(g, alpha=1 - beta1)
    update = lambda: m.mul_(beta2).add_(g, alpha=1 - beta2)  # noqa: E731
    if fresh is None:
        update()
    else:  # d has read m: its update can wait for the commit
        fresh.append(update)
    return d


@direction("storm", Storm, state=(MOMENTUM, StateKey("prev", layout=PARAM)), migrates="storm",
           refuses=(("capturable", "the closure is evaluated on the host"),))
def storm(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """STORM (Theorem 4.5): d⁰ = g(x₀, ξ₀); then d ← g(x_k, ξ_k) + (1−α)(d − g(x_{k−1}, ξ_k)),
    both gradients on the same batch ξ_k (``g_prev`` comes from re-evaluating the closure at the
    previous iterate)."""
    buf = state.get("d")
    if buf is None:
        state["d"] = g.clone()
        return state["d"]
    if g_prev is None:
        raise RuntimeError("storm needs g(x_{k-1}, ξ_k): call step(closure)")
    diff = torch.sub(buf, g_prev) if fresh is not None else buf.sub_(g_prev)
    buf = state["d"] = diff.mul_(1 - group["alpha"]).add_(g)
    return buf


def polyak_lookahead_rows(u: torch.Tensor, d: torch.Tensor, gs: list, alpha) -> torch.Tensor:
    """u[i] = g_i.lerp(d[i].lerp(g_i, α), 1 − α) row by row (:func:`polyak_lerp` into u, then
    :func:`polyak_lookahead` over it): Nesterov's look-ahead from the old d, d left as it is."""
    for i, g in enumerate(gs):
        polyak_lerp(d[i], g, alpha, out=u[i])  # d⁺
        polyak_lookahead(g, u[i], alpha, out=u[i])
    return u


def polyak_rows(gs: list, state: dict, group: dict, lookahead: Callable, fresh: Optional[list] = None,
                lookahead_rows: Optional[Callable] = None) -> torch.Tensor:
    """Polyak momentum (:func:`geomopt.optim.units.directions.polyak`, same arithmetic) read from
    the unstacked gradients: d ← d.lerp(g, α) row by row into the stacked state, and with
    Nesterov u = g.lerp(d, 1 − α) written into ``lookahead(shape, like)`` (a scratch; no copy of G).

    ``fresh`` (a list): the state is left as it is until the bucket commits. With Nesterov, where
    the scratch holds d's dtype, d⁺ = d.lerp(g, α) is formed in it (and u over it, in place), and
    the write of d, the same lerp again, is appended to ``fresh``: one more pass over d and G and
    no new memory, where a new d would cost the scratch's pass plus its fresh pages (8% of a CPU
    muon step, measured). Else d⁺ is a new tensor that replaces d in ``state`` (without Nesterov
    the cheaper of the two: 1.02× against 1.11× the in-place step of adamuon on a CPU).
    ``lookahead_rows(u, new, d, gs, α)`` (with Nesterov and ``fresh``): d⁺ written into a new d
    (``new``, bound at the commit) and u from it in one pass (compiled: d and G read once, no
    put-off update reading G again); with Nesterov, ``fresh`` None and d there, ``new`` is d itself
    (d⁺ written in place: a capturable step's compiled look-ahead, whose bucket journals d)."""
    alpha = group["alpha"]
    d = state.get("d")
    if d is not None and fresh is None and lookahead_rows is not None and group["nesterov"]:
        u = lookahead(d.shape, d)
        lookahead_rows(u, d, d, gs, alpha)
        return u
    if d is None:
        if group["init"] == "gradient":
            d = state["d"] = torch.stack(gs)
            return d  # d⁰ = g⁰ (Nesterov: g.lerp(g, ·) = g)
        d = state["d"] = torch.zeros((len(gs), *gs[0].shape), dtype=gs[0].dtype, device=gs[0].device)
        fresh = None  # a new d already: written in place, bound at the commit
    if fresh is not None:
        u = lookahead(d.shape, d) if group["nesterov"] else None
        if u is not None and lookahead_rows is not None:  # d⁺ into a new d and u, one pass over d and G
            new = state["d"] = torch.empty_like(d)
            lookahead_rows(u, new, d, gs, alpha)
            return u
        if u is not None and u.dtype == d.dtype:
            polyak_lookahead_rows(u, d, gs, alpha)
            old = d
            fresh.append(lambda: polyak_lerp(list(old.unbind(0)), gs, alpha))
            return u
        new = state["d"] = torch.empty_like(d)
        for i, g in enumerate(gs):
            polyak_lerp(d[i], g, alpha, out=new[i])
        d = new
    else:
        polyak_lerp(list(d.unbind(0)), gs, alpha)
    if not group["nesterov"]:
        return d
    # u in the dtype the forward op casts it to first (bf16 for Newton–Schulz on CUDA): the
    # lerp rounds once into it, so the cast pass is saved and the bits are the same
    u = lookahead(d.shape, d)
    for i, g in enumerate(gs):
        polyak_lookahead(g, d[i], alpha, out=u[i])
    return u


def polyak_ahead(gs, state: dict, group: dict, lookahead: Callable, fresh: bool = False) -> tuple:
    """:func:`polyak_rows` with the write of d put off, for a step that waits for its finiteness
    test after the forward ops: the gradients are stacked once (a transient copy, one launch
    instead of one per tensor: on an H100 the step is bound by the host's launches, measured
    5% faster), u is read from them and the old d into a scratch (``lookahead``, in the
    forward op's dtype), and the returned ``commit()`` writes d ← d.lerp(g, α) later.
    Without Nesterov u = d.lerp(g, α) (the new d); with it g.lerp(d⁺, 1 − α) = β²d + (1 −
    β²)g, β = 1 − α, read as d.lerp(g, 1 − β²) (the same value, rounded once). ``fresh``: the
    commit puts a new d in ``state`` rather than writing the old one in place. ``gs`` may be the
    stacked gradients already (a copy of them the step owns: a capturable step's selected ones)."""
    alpha, nesterov = group["alpha"], group["nesterov"]
    owned = isinstance(gs, torch.Tensor)
    g: torch.Tensor = gs if isinstance(gs, torch.Tensor) else stack(gs)
    u = lookahead(g.shape, g)
    d = state.get("d")
    if d is None and group["init"] == "gradient":  # d⁰ = g⁰, and with Nesterov u = g too
        u.copy_(g)
        return u, lambda: state.__setitem__("d", g.clone() if len(gs) == 1 and not owned else g)
    weight = polyak_ahead_weight(alpha, nesterov)
    if d is None:  # d = 0
        torch.mul(g, weight, out=u)
    else:
        polyak_lerp(d, g, weight, out=u)

    def commit():
        if state.get("d") is None:
            state["d"] = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
        d = state["d"]
        state["d"] = polyak_lerp(d, g, alpha, out=torch.empty_like(d) if fresh else None)

    return u, commit


#: the seed of Dion's initial right factor Q⁰ (a standard Gaussian n×r, the same for every matrix
#: of a shape, so a run is reproducible and a transcription can start from the same Q⁰)
DION_SEED = 0


def dion_rank(rank, shape) -> int:
    """Dion's rank r for a tensor of ``shape`` read as (shape[0], rest): an int as it is, a
    fraction of min(m, n) rounded up."""
    m, n = shape[0], math.prod(shape[1:])
    return rank if isinstance(rank, int) else max(1, math.ceil(rank * min(m, n)))


def dion_q0(n: int, r: int, like: torch.Tensor) -> torch.Tensor:
    """Q⁰ of an n×r right factor: N(0, 1) entries drawn on the CPU from :data:`DION_SEED`."""
    q = torch.randn(n, r, generator=torch.Generator().manual_seed(DION_SEED), dtype=torch.float64)
    return q.to(dtype=like.dtype, device=like.device)


@direction("dion", Dion, state=(MOMENTUM, StateKey("dion_q", layout=OWN)), migrates="dion", locality=OWNER,
           refuses=(("sharded", "it needs whole matrices for its power iteration and QR (microsoft/dion's "
                                "distributed QR is not reproduced); use it with replicated tensors (DDP)"),))
def dion(g, state, group, *, g_prev=None, inplace=False, fresh=None):
    """Dion (Ahn, Xu, Abreu & Langford 2025, "Dion: Distributed Orthonormalized Updates",
    arXiv:2504.05295, Algorithm 1, single-device form as microsoft/dion's dion/dion_simple.py
    runs it), on each matrix of the stack (a tensor read as m = shape[0] rows by n = the rest):

        B = M + G;  P = orth(B·Q) (reduced QR);  R = Bᵀ·P
        M ← B − (1 − μ)·P·Rᵀ          (error feedback: what the rank-r step left out stays)
        Q ← R / (‖R_{:,j}‖ + ε)       (column by column)
        d = √(m/n)·P·Qᵀ

    M⁰ = 0 (state ``d``), Q⁰ a Gaussian n×r (:func:`dion_q0`, state ``dion_q``); r from the
    group's ``rank`` (:func:`dion_rank`, checked against the shape when the optimizer is built).
    d is Dion's whole update, √(m/n) its shape scale included: the rule's geometry is
    ``euclidean`` (∇φ*(d) = d), so X ← X(1 − γλ) − γ·d as in the reference. New tensors replace
    the state (nothing is written in place), so a step that is skipped or aborted leaves it."""
    shape = g.shape  # (tensors, m, …): the bucket's stacked gradients
    b_dim, m = shape[0], shape[1]
    g = g.reshape(b_dim, m, -1)
    n = g.shape[2]
    m_buf = state.get("d")
    b = g.clone() if m_buf is None else m_buf.reshape(b_dim, m, n) + g
    q = state.get("dion_q")
    if q is None:
        q = dion_q0(n, dion_rank(group["rank"], (m, n)), g).expand(b_dim, -1, -1)
    p, _ = torch.linalg.qr(torch.bmm(b, q))
    r_fac = torch.bmm(b.transpose(1, 2), p)
    state["d"] = torch.baddbmm(b, p, r_fac.transpose(1, 2), alpha=-(1 - group["mu"])).reshape(shape)
    q = state["dion_q"] = r_fac / (r_fac.norm(dim=1, keepdim=True) + group["eps"])
    return torch.bmm(p, q.transpose(1, 2)).mul_(math.sqrt(m / n)).reshape(shape)


def previous_gradients(opt, closure) -> dict:
    """g(x_{k−1}, ξ_k) for STORM (``opt``: the GeomOptimizer): swap in the previous iterate,
    evaluate, swap back. Tensors without a previous iterate (first step, or never had a gradient)
    stay at the current one and get d = g on their first step (no second evaluation when no
    tensor has one)."""
    params = [p for g in opt.param_groups for p in g["params"] if "prev" in opt.state[p]]
    if not params:
        return {}  # first step: d⁰ = g(x₀, ξ₀), no second evaluation
    with torch.no_grad():
        current = [p.detach().clone() for p in params]
        for p in params:
            p.copy_(opt.state[p]["prev"])
    try:
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            closure()
        out = {p: (p.grad.detach().clone() if p.grad is not None else None) for p in params}
    finally:
        with torch.no_grad():
            for p, x in zip(params, current):
                p.copy_(x)
    return out
