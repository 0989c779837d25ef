"""The batched variant of a step program (:mod:`geomopt.optim.program`): a bucket's same-shape
tensors stacked, direction → forward op → post-stages → weight decay → backward op, as a
generator of operator requests so the executors (:mod:`geomopt.distributed`) can share a round's
matrix work across ranks."""

from __future__ import annotations

import math
from typing import Optional

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import Request, is_dtensor
from geomopt.registry import LOCAL, OWNER
from geomopt.distributed.layout import whole_matrices
from geomopt.geometry.adam import adam_moments
from geomopt.geometry.prox import backward
from geomopt.geometry.forward import forward, input_dtype
from geomopt.geometry.operators import backward_locality, forward_locality
from geomopt.optim import stages as post_stages
from geomopt.optim.directions import DIRECTIONS, polyak_ahead, polyak_rows
from geomopt.optim.atomic import guarded, journal
from geomopt.optim.graphs import GraphedOp
from geomopt.optim.tensors import local, op_view, stack, upcast
from geomopt.optim.program import Program
from geomopt.optim.runtime import Runtime


def radius_factor(pp: ParamPlan) -> float:
    """The tensor's factor on the group's radius: its scale preset for this shape (ρ = group
    radius × factor)."""
    return pp.radius / pp.geometry["radius"]


def step_bucket(prog: Program, rt: Runtime, state, counters: dict, group: dict, items: list, g, g_prev,
                gamma: float, alpha, shared: bool = False):
    """:func:`_bucket_step` guarded: an exception in it, or thrown into it at one of its operator
    requests, restores the state it had updated in place (:mod:`geomopt.optim.atomic`)."""
    saved: list = []
    return guarded(_bucket_step(prog, rt, state, counters, group, items, g, g_prev, gamma, alpha, shared,
                                saved=saved), saved)


def _bucket_step(prog: Program, rt: Runtime, state_of, counters: dict, group: dict, items: list, g, g_prev,
                 gamma: float, alpha, shared: bool, *, saved: list):
    """One batched step of same-shape tensors (a job of ``prog``'s bucket): leading dim = tensor
    index (batch_dims=1).

    A generator: it yields a :class:`Request` for the forward and for the backward operator and
    receives ``(out, flags)``, so :func:`~geomopt.optim.atomic.drive` can hand a round's operators
    to the executor together (locally, or shared out across ranks). ``g``: the stacked gradients,
    or a list of them (``prog.direction_form`` rows / ahead); ``alpha``: the direction's α as
    scheduled (None: the group's); ``shared``: the buckets run one after another, so this one may
    use the workspace; ``saved``: where the bucket journals the state it updates in place before
    an operator request that may still fail (:mod:`geomopt.optim.atomic`). Every hyper-parameter
    is the group's; the plan gives the operators and the tensor's radius factor."""
    pp = items[0][1]
    views = [op_view(local(p), q) for p, q in items]
    hyper = group if alpha is None else dict(group, alpha=alpha)
    state = rt.stacked.gather(state_of, items)
    if prog.keeps_prev:
        state["prev"] = torch.stack([local(p).detach() for p, _ in items]).clone()
    post = pp.post
    reads = post_stages.reads(post) if post else set()
    g_raw = None
    if "gradient" in reads:  # the raw gradient, before a direction may overwrite its copy
        g_raw = upcast(stack(g)) if isinstance(g, list) else upcast(g).clone()
    wd = group["weight_decay"]
    rho = group["radius"] * radius_factor(pp)
    geometry = pp.geometry
    constraint = pp.constraint
    projects = constraint is not None and gamma * rho != 0
    # in one process the state changes only when the bucket commits (its last request has
    # answered): directions update it out of place (``fresh``), and state updated in place
    # before a request (Adam's moments, post-stages' statistics) is journaled
    fresh: Optional[list] = [] if prog.journal else None  # updates the direction puts off until the commit
    if prog.journal and geometry["kind"] == "adam":  # its moments (d and the stages' state: fresh)
        saved.extend(journal(rt.stacked.live(items, state, ("exp_avg", "exp_avg_sq"))))
    commit = None
    if prog.direction_form == "ahead":
        d, commit = polyak_ahead(g, state, hyper, lambda shape, like: _lookahead(prog, rt, items, shape, like, False),
                                 fresh=prog.journal)
    elif prog.direction_form == "rows":
        d = polyak_rows(g, state, hyper, lambda shape, like: _lookahead(prog, rt, items, shape, like, shared),
                        fresh=fresh)
    else:
        gu = upcast(g)
        # the stacked (or upcast) gradient is this step's own copy: the direction may overwrite it
        d = DIRECTIONS[group["direction"]](gu, state, hyper, g_prev=None if g_prev is None else upcast(g_prev),
                                           inplace=len(items) > 1 or gu is not g, fresh=fresh)
    decay = 1 - gamma * wd
    cautious_decay = wd != 0 and pp.decay == "cautious"
    # one pass: the forward op folds a constant radius r into its result S = r·∇φ₁*(d), written
    # in X's dtype, and X.lerp_(S, γ·wd) with r = −ρ/wd is X(1 − γ·wd) − γρ·∇φ₁*(d); without
    # decay X += γ·S with r = −ρ
    one_pass = prog.write == "one-pass"
    lerp = one_pass and wd != 0 and abs(rho / wd) < 1e30
    radius = (-rho / wd if lerp else -rho) if one_pass else 1.0
    if geometry["kind"] != "adam":
        step, _ = yield request(rt, items, d, forward_locality(geometry["kind"]),
                                 _forward_fn(prog, rt, items, geometry, radius, views[0].dtype if one_pass else None))
    if commit is not None:
        commit()
    if post and geometry["kind"] != "adam":
        step = yield from _post(rt, items, pp, state, step, g_raw, d, prog.journal)
    if prog.write != "stacked":  # X ← X(1 − γ·wd) − γρ·∇φ₁*(d) on the parameters themselves
        steps = list(step.unbind(0))
        if lerp:
            torch._foreach_lerp_(views, steps, gamma * wd)
        else:
            # torch Muon's op order (same bits on CPU): decay, then the axpy of the step (ρ
            # already in it where the forward op folded it)
            if wd:
                torch._foreach_mul_(views, decay)
            torch._foreach_add_(views, steps, alpha=gamma if one_pass else -gamma * rho)
        for update in fresh or ():
            update()
        rt.stacked.scatter(state_of, items, state)
        return
    x = upcast(stack(views))
    if geometry["kind"] == "adam" and not post:
        exp_avg, denom, bc1 = adam_moments(d, state, geometry)
        xw = decayed(x, exp_avg, decay, cautious_decay) if wd else x
        y = xw.addcdiv(exp_avg, denom, value=-gamma / bc1)  # AdamW's op order, bit for bit
    else:
        if geometry["kind"] == "adam":  # the adam geometry's update, then the post-stages
            exp_avg, denom, bc1 = adam_moments(d, state, geometry)
            step = yield from _post(rt, items, pp, state, exp_avg / denom / bc1, g_raw, d, prog.journal)
        # Y = X(1 − γ·wd) − γρ·∇φ₁*(d): ρ folds into the axpy (one pass fewer than scaling the
        # forward output), and the decayed copy of X is updated in place
        if wd:
            y = decayed(x, step, decay, cautious_decay).add_(step, alpha=-gamma * rho)
        else:
            y = torch.add(x, step, alpha=-gamma * rho)
    if projects:  # (a step of length 0 leaves X, feasible, as it is)
        x_new, fallback = yield request(
            rt, items, y, backward_locality(geometry["kind"], constraint["kind"]),
            lambda m: backward(m, gamma, geometry, constraint, radius=rho, batch_dims=1))
    else:
        x_new, fallback = y, None
    if fallback is not None:
        counters["fallbacks"] = counters["fallbacks"] + fallback.sum().to(counters["fallbacks"].device)
    if prog.track_gap and constraint is not None and gamma * rho > 0:
        state["w"] = (x_new - y) / (gamma * rho)
    if prog.track_update and _first_holder(rt, items[0][0]):  # replicas count their block once
        delta = (x_new - x).reshape(-1)
        counters["update_sq"] = counters["update_sq"] + torch.dot(delta, delta).to(counters["update_sq"].device)
    for update in fresh or ():
        update()
    rt.stacked.scatter(state_of, items, state)
    torch._foreach_copy_(views, list(x_new.unbind(0)))


def _post(rt: Runtime, items: list, pp: ParamPlan, state: dict, u: torch.Tensor, g_raw, d, fresh: bool):
    """The rule's post-stages on the bucket's update ``u`` (:mod:`geomopt.optim.stages`), as one
    request (a sub-generator of :func:`_bucket_step`); their step count is per tensor."""
    step = state.get(post_stages.STAGE_STEP, 0) + 1
    state[post_stages.STAGE_STEP] = step
    shard = None
    p = items[0][0]
    if is_dtensor(p):  # sums over a cut dim are all-reduced by the stages themselves
        layout = rt.stacked.layouts[id(p)]
        shard = post_stages.Shard(layout.mine(), layout.cuts, layout.mesh)
    ctx = post_stages.Context(state, pp.op_shape, view=pp.geometry.get("view"), gradient=g_raw,
                              direction=None if d is None else upcast(d), step=step, shard=shard, fresh=fresh)
    # local on every executor: the stages sum across shards where they need to (Context.sum),
    # the same collectives in the same order on every rank
    out, _ = yield Request(lambda m: (post_stages.run(m, list(pp.post), ctx), None), u, LOCAL)
    if shard is not None:
        rt.stacked.reduced[tuple(id(q) for q, _ in items)] = dict(ctx.reduced)
    return out


def _forward_fn(prog: Program, rt: Runtime, items: list, geometry: dict, radius: float = 1.0, out_dtype=None):
    """The bucket's forward op (``radius``·∇φ₁*, in ``out_dtype``); replayed from a CUDA graph
    (:mod:`geomopt.optim.graphs`) where the program is ``graphed`` (the graph reads the bucket's
    kept scratch u in place when that is its input)."""
    fn = lambda m: (forward(m, geometry, radius=radius, batch_dims=1, out_dtype=out_dtype), None)  # noqa: E731
    if not prog.graphed:
        return fn
    ids = tuple(id(p) for p, _ in items)
    key = ids + (radius, out_dtype)  # the graph bakes both in
    op = rt.graphs.get(key)
    if op is None:
        if len(rt.graphs) >= rt.graph_cap:
            return fn  # buckets split by missing gradients in many ways: no graph per split
        op = rt.graphs[key] = GraphedOp(fn)
    op.scratch = rt.buffers.get(ids + ("u",))
    return op


def request(rt: Runtime, items: list, x: torch.Tensor, locality: str, fn) -> Request:
    """An operator request for a bucket (sharding read off its first parameter)."""
    p, pp = items[0]
    cost = pp.matrix_cost
    if not is_dtensor(p):
        return Request(fn, x, locality, cost=cost)
    layout = rt.stacked.layouts[id(p)]
    if locality == OWNER and whole_matrices(pp.geometry.get("view"), layout.cuts):
        # experts cut whole across ranks: each rank's matrices (the cost: of its share of them)
        share = x[0].numel() / math.prod(pp.op_shape)
        return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape,
                       cost=None if cost is None else cost * share, whole=True)
    return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape, cost=cost)


def _first_holder(rt: Runtime, p) -> bool:
    """Whether this rank's block of ``p`` is the first copy of it (always, unsharded)."""
    return not is_dtensor(p) or rt.stacked.layouts[id(p)].primary(rt.executor.rank)


def _lookahead(prog: Program, rt: Runtime, items: list, shape, like: torch.Tensor, shared: bool) -> torch.Tensor:
    """Where a bucket writes its direction u (in the dtype the forward op casts it to first):
    kept per bucket when a CUDA graph reads it in place; the workspace when the buckets run one
    after another (``shared``); else fresh memory, freed after the step (buckets whose steps
    interleave: distributed rounds, the deferred finiteness test)."""
    dtype = input_dtype(items[0][1].geometry, like)
    if prog.graphed:
        return rt.stacked.kept(items, "u", shape, like, dtype=dtype)
    if shared:
        return rt.workspace.take("u", shape, dtype, like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def decayed(x: torch.Tensor, step: torch.Tensor, decay: float, cautious: bool) -> torch.Tensor:
    """X(1 − γλ) (decoupled), or, cautious (Chen et al. 2025), X(1 − γλ) only where the step S and
    X agree in sign (S⊙X ≥ 0) and X elsewhere."""
    if not cautious:
        return x * decay
    return torch.where(step * x >= 0, x * decay, x)
