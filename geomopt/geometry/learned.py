"""The ``kronecker`` forward op: a geometry whose metric is learned from the directions it maps,
one step of Shampoo, SOAP or PSGD-Kron on a matrix or a bucket's stack, with its state.

Per matrix D (the (shape[0], rest) view, or a rule's ``view``'s matrices: experts, equal blocks; a
bucket's stack (b, m, n)), each step
(:mod:`geomopt.geometry.kron` has the arithmetic, docs/reference/kron.md the formulas):

* ``shampoo``: L ← βL + w·D·Dᵀ, R ← βR + w·Dᵀ·D (w = 1 − β; β = 1: w = 1); at steps ``every``,
  2·``every``, … the roots (L + εI)^(−1/p), (R + εI)^(−1/p) are recomputed (identity before the
  first); the update L^(−1/p)·D·R^(−1/p), its Frobenius norm optionally grafted onto another
  map's: AdaGrad's D/(√ΣD² + ε), Adam's D/(√v̂ + ε) (v ← β₂v + (1−β₂)D², bias-corrected), or the
  spectral map's (an orthogonal factor of full rank: √min(m, n)).
* ``soap``: the first step starts the factors and their eigenbases and moves nothing; then Adam in
  the eigenbases (:func:`geomopt.geometry.kron.soap_direction`), the factors' update, and every
  ``every`` steps one power iteration and a QR of the bases.
* ``psgd``: PSGD-Kron (:mod:`geomopt.geometry.kron_psgd`): its own momentum m ← μm + (1 − μ)D,
  debiased; every ``every`` steps the triangular factors Q_L, Q_R are fitted on (V, m̂), V a probe
  drawn from a generator seeded with the step (the same on every rank and after a resume); the
  update Q_LᵀQ_L·m̂·Q_RᵀQ_R with its RMS capped at 1.1.

A side longer than ``max_dim`` keeps no factor (an empty entry in the state); under ``psgd``, a
diagonal one. The step counts are host integers (the schedule of the refreshes), so the op runs
where the host decides: not under ``capturable``. Its state lives with the whole matrix: on
replicated tensors (DDP) every rank runs it on its whole copy (``LOCAL``: no rank owns a matrix, so
each keeps the same factors, the iterates of one process; PSGD's probes are the step's on every
rank); on sharded tensors (FSDP2, HSDP, TP), whose matrices are cut across ranks, it is ``OWNER``
(the registration's ``sharded`` locality): each matrix is gathered whole on one rank, fixed for the
run, which keeps that matrix's whole state (factors, roots, bases, moments, step count) and sends
every rank its block of the direction (:mod:`geomopt.optim.engine.owned`).
"""

from __future__ import annotations

import math
from typing import cast

import torch

from geomopt.geometry import kron, kron_psgd
from geomopt.geometry.matrix import matrix_view, upcast
from geomopt.geometry.operators import FORWARD_OPS
from geomopt.registry import LOCAL, OWNER
from geomopt.compile.fragments import ResolvedGeometry, View
from geomopt.spec.geometries import Kronecker

#: why the op has no form under these settings (the optimizer's construction reads them)
REFUSES = (
    ("capturable", "its roots and bases are recomputed on a schedule the host reads from the step count"),
)


def _put(state: dict, key: str, value, like: torch.Tensor, store: tuple) -> None:
    """``state[key] = value``, its leading dim (one per matrix of ``like``) stored as ``store`` (the
    bucket's and the view's dims, :func:`kronecker`); a side kept by no factor holds an empty entry
    (…, 0): every key is in the state of every tensor the geometry steps, which checkpoints and
    migrations read as one."""
    value = like.new_empty(*like.shape[:-2], 0) if value is None else value
    state[key] = value.reshape(*store, *value.shape[like.ndim - 2:])


def _factor(state: dict, key: str, like: torch.Tensor, store: tuple):
    """A factor, root or basis of the state, one per matrix of ``like`` (a view of the stored entry:
    updates in place reach it); None for a side that keeps none."""
    value = state.get(key)
    return None if value is None or value.numel() == 0 else _stored(value, like, store)


def _stored(value: torch.Tensor, like: torch.Tensor, store: tuple) -> torch.Tensor:
    """A stored entry read one per matrix of ``like`` (a view)."""
    return value.reshape(*like.shape[:-2], *value.shape[len(store):])


def _moment(state: dict, key: str, g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """An entry laid out as the operators see the tensor (``shape``: the bucket's (b, …) or one
    tensor's), created zero; returned as the matrices ``g`` is (a view: updates in place reach it)."""
    if key not in state:
        state[key] = g.new_zeros(shape)
    return state[key].view(g.shape)


def _weight(beta: float) -> float:
    """w of the factors' update: 1 − β, or 1 for the plain sum (β = 1)."""
    return 1.0 if beta == 1 else 1.0 - beta


def shampoo(g: torch.Tensor, state: dict, cfg: Kronecker, shape: torch.Size, store: tuple) -> torch.Tensor:
    """One Shampoo step on ``g`` (m, n) or (b, m, n) with its ``state`` (filled on the first step);
    ``shape``: the operators' shape of the tensors (their moments' layout); ``store``: the leading
    dims the per-matrix entries are stored under."""
    if "shampoo_step" not in state:
        left, right = kron.init_factors(g.shape, cfg.max_dim, dtype=g.dtype, device=g.device)
        left_root, right_root = kron.init_factors(g.shape, cfg.max_dim, eps=1.0, dtype=g.dtype, device=g.device)
        for key, value in (("shampoo_left", left), ("shampoo_right", right), ("shampoo_left_root", left_root),
                           ("shampoo_right_root", right_root)):
            _put(state, key, value, g, store)
        if cfg.graft in ("adagrad", "adam"):
            _moment(state, "shampoo_graft", g, shape)
        else:
            _put(state, "shampoo_graft", None, g, store)
        state["shampoo_step"] = 0
    left, right = _factor(state, "shampoo_left", g, store), _factor(state, "shampoo_right", g, store)
    left_root = _factor(state, "shampoo_left_root", g, store)
    right_root = _factor(state, "shampoo_right_root", g, store)
    step = state["shampoo_step"] = state["shampoo_step"] + 1
    kron.update_factors(g, left, right, beta=cfg.beta, weight=_weight(cfg.beta))
    if kron.refresh_due(step, cfg.every):
        kron.refresh_roots(left, right, left_root, right_root, p=kron.root_order(left, right, cfg.exponent),
                           eps=cfg.damping, method=cfg.root)
    d = kron.shampoo_direction(g, left_root, right_root)
    graft = cfg.graft
    if graft == "none":
        return d
    if graft == "spectral":  # ‖U·Vᵀ‖_F = √min(m, n) for a full-rank m × n matrix
        return kron.graft_to_norm(d, math.sqrt(min(g.shape[-2:])))
    acc = _moment(state, "shampoo_graft", g, shape)
    if graft == "adagrad":
        acc.addcmul_(g, g)
        return kron.graft(d, g / (acc.sqrt() + cfg.eps))
    beta2 = cfg.betas[1]  # adam
    acc.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return kron.graft(d, g / ((acc / (1 - beta2**step)).sqrt() + cfg.eps))


def soap(g: torch.Tensor, state: dict, cfg: Kronecker, shape: torch.Size, store: tuple) -> torch.Tensor:
    """One SOAP step on ``g`` (m, n) or (b, m, n) with its ``state``: zero on the first (which starts
    the factors and their eigenbases), Adam in the eigenbases after."""
    beta = cfg.beta
    if "soap_step" not in state:
        left, right = kron.init_factors(g.shape, cfg.max_dim, dtype=g.dtype, device=g.device)
        kron.update_factors(g, left, right, beta=beta, weight=_weight(beta))
        q_left, q_right = kron.soap_bases(left, right)
        for key, value in (("soap_left", left), ("soap_right", right), ("soap_left_basis", q_left),
                           ("soap_right_basis", q_right)):
            _put(state, key, value, g, store)
        _moment(state, "soap_exp_avg", g, shape)
        _moment(state, "soap_exp_avg_sq", g, shape)
        state["soap_step"] = 0
        return torch.zeros_like(g)
    left, right = _factor(state, "soap_left", g, store), _factor(state, "soap_right", g, store)
    q_left, q_right = _factor(state, "soap_left_basis", g, store), _factor(state, "soap_right_basis", g, store)
    exp_avg, exp_avg_sq = _moment(state, "soap_exp_avg", g, shape), _moment(state, "soap_exp_avg_sq", g, shape)
    step = state["soap_step"] = state["soap_step"] + 1
    d = kron.soap_direction(g, exp_avg, exp_avg_sq, q_left, q_right, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                            step=step)
    kron.update_factors(g, left, right, beta=beta, weight=_weight(beta))
    if kron.refresh_due(step, cfg.every):
        kron.soap_refresh(left, right, q_left, q_right, exp_avg_sq)
    return d


def psgd(g: torch.Tensor, state: dict, cfg: Kronecker, shape: torch.Size, store: tuple) -> torch.Tensor:
    """One PSGD-Kron step on ``g`` (m, n) or (b, m, n) with its ``state`` (factors at the identity on the
    first step): m ← μm + (1 − μ)G, ĥ = m/(1 − μᵗ); at steps ``every``, 2·``every``, … the factors are
    balanced and fitted on (V, ĥ), V the step's probe; the update P·ĥ, its RMS capped at 1.1."""
    if "psgd_step" not in state:
        factors = kron_psgd.init_factors(g.shape, cfg.max_dim, dtype=g.dtype, device=g.device)
        for key, value in zip(("psgd_left", "psgd_right"), factors):
            _put(state, key, value, g, store)
        _moment(state, "psgd_momentum", g, shape)
        state["psgd_step"] = 0
    q_left, q_right = (_stored(state[key], g, store) for key in ("psgd_left", "psgd_right"))
    m = _moment(state, "psgd_momentum", g, shape)
    step = state["psgd_step"] = state["psgd_step"] + 1
    mu = cfg.momentum
    m.mul_(mu).add_(g, alpha=1 - mu)
    h = m / (1.0 - math.pow(mu, step))
    if kron.refresh_due(step, cfg.every):
        kron_psgd.balance(q_left, q_right, h)
        kron_psgd.fit(h, kron_psgd.probe(h, step), q_left, q_right, lr=cfg.precond_lr)
    return kron_psgd.cap_rms(kron_psgd.precondition(h, q_left, q_right))


METHODS = {"shampoo": shampoo, "soap": soap, "psgd": psgd}

#: per method, the state its step writes only when it refreshes (steps ``every``, 2·``every``, …):
#: Shampoo's roots, SOAP's bases, PSGD-Kron's factors
REFRESHED = {"shampoo": ("shampoo_left_root", "shampoo_right_root"),
             "soap": ("soap_left_basis", "soap_right_basis"), "psgd": ("psgd_left", "psgd_right")}


def unchanged_by_step(geometry: ResolvedGeometry, state: dict) -> tuple[str, ...]:
    """The state keys the next step of a kronecker ``geometry`` leaves as they are, given its
    ``state`` (a bucket's, its step count a host int): the entries :data:`REFRESHED` where that step,
    the count + 1, refreshes nothing; () on a first step (it creates them) and for other geometries.
    A step journals what it may change in place (:mod:`geomopt.optim.engine.atomic`): not these."""
    if geometry.kind != "kronecker":
        return ()
    spec = cast(Kronecker, geometry.spec)
    method = spec.method
    count = state.get(f"{method}_step")
    if count is None or kron.refresh_due(int(count) + 1, spec.every):
        return ()
    return REFRESHED[method]


def view_problem(view: View) -> str | None:
    """Why the kronecker geometry cannot read its tensor through a resolved ``view``, or None. Its
    state is one entry per matrix stacked in a tensor, so every matrix has one shape (equal
    blocks), in the tensor's own memory order (no ``trailing: batch`` over kernel positions,
    which permutes the entries)."""
    blocks = view.blocks
    if blocks and len(set(blocks)) > 1:
        return (f"the kronecker geometry keeps one factor shape per tensor, and view blocks {list(blocks)} are of "
                f"different sizes; use equal blocks or no view")
    if view.trailing == "batch":
        return "the kronecker geometry reads views with trailing: cols only; use trailing: cols or no view"
    return None


def _view_matrices(x: torch.Tensor, batch_dims: int, view: View) -> torch.Tensor:
    """The matrices (N, m, n) of ``x`` under a resolved ``view`` (the leading ``batch_dims`` dims
    index a bucket's tensors): the view's batch axes and the equal blocks of the rows, in memory
    order (a view of ``x``)."""
    problem = view_problem(view)
    if problem is not None:
        raise ValueError(problem)
    shape = x.shape[batch_dims:]
    b = view.batch
    k = len(view.blocks or [0]) or 1
    return x.reshape(-1, shape[b] // k, math.prod(shape[b + 1:]))


@FORWARD_OPS.register("kronecker", locality=LOCAL, sharded=OWNER, refuses=REFUSES, reads_view=True)
def kronecker(d, geometry: ResolvedGeometry, *, radius, batch_dims=0, state=None, out_dtype=None):
    """ρ times one step of the geometry's ``method`` on each matrix of ``d`` (the leading
    ``batch_dims`` dims index a bucket's tensors), in float32 at least; ``state`` (required) is
    filled on the first step. The matrices are the (shape[0], rest) one per tensor, or a resolved
    ``view``'s (experts, equal blocks: :func:`view_problem`), each with its own factors: the state
    entries are stored (bucket, matrix, …)."""
    if state is None:
        raise ValueError("the kronecker forward op carries state: pass a dict (empty on the first step)")
    x = upcast(d)
    view = geometry.view
    if view is None:
        mats = matrix_view(x, batch_dims)
        store = tuple(mats.shape[:-2])
    else:
        mats = _view_matrices(x, batch_dims, view)
        lead = tuple(x.shape[:batch_dims])
        store = (*lead, mats.shape[0] // math.prod(lead))
    spec = cast(Kronecker, geometry.spec)
    out = METHODS[spec.method](mats, state, spec, x.shape, store)
    return (out * radius).reshape(d.shape).to(out_dtype or d.dtype)
