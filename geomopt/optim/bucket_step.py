"""One batched step of a bucket (same-shape tensors of a rule): direction → forward op →
post-stages → weight decay → backward op, as a generator of operator requests so the executors
(:mod:`geomopt.distributed`) can share a round's matrix work across ranks."""

from __future__ import annotations

import math
from typing import Optional

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import LocalExecutor, Request, is_dtensor
from geomopt.registry import LOCAL, OWNER
from geomopt.distributed.layout import whole_matrices
from geomopt.geometry.adam import adam_moments
from geomopt.geometry.prox import backward
from geomopt.geometry.forward import forward, input_dtype
from geomopt.geometry.operators import backward_locality, forward_locality
from geomopt.geometry.dtypes import POLYNOMIAL_APPROXES
from geomopt.geometry.polynomial import muon_order
from geomopt.optim import stages as post_stages
from geomopt.optim.directions import DIRECTIONS, polyak_ahead, polyak_rows
from geomopt.optim.atomic import guarded, journal
from geomopt.optim.graphs import GraphedOp
from geomopt.optim.tensors import local, op_view, stack, upcast
from geomopt.optim.host import Host


class BucketStep(Host):
    """A bucket's step (a mixin of :class:`~geomopt.optim.GeomOptimizer`)."""

    def _step_bucket(self, *args, **kwargs):
        """:meth:`_bucket_step` guarded: an exception in it, or thrown into it at one of its
        operator requests, restores the state it had updated in place (:mod:`geomopt.optim.atomic`)."""
        saved: list = []
        return guarded(self._bucket_step(*args, saved=saved, **kwargs), saved)

    def _bucket_step(self, gi: int, group: dict, items: list, g: torch.Tensor, g_prev, gamma: float, alpha,
                     deferred: bool = False, shared: bool = False, *, saved: list):
        """One batched step of same-shape tensors: leading dim = tensor index (batch_dims=1).

        A generator: it yields a :class:`Request` for the forward and for the backward operator
        and receives ``(out, flags)``, so :func:`~geomopt.optim.atomic.drive` can hand a round's operators to the
        executor together (locally, or shared out across ranks). ``deferred``: write nothing
        before the first yield (:meth:`_can_defer`); ``shared``: the buckets run one after another
        (:func:`~geomopt.optim.atomic.drive`), so this one may use the workspace. ``saved``: where
        the bucket journals the state it updates in place before an operator request that may
        still fail (one process: :mod:`geomopt.optim.atomic`)."""
        counters = self._counters[gi]
        pp = items[0][1]
        views = [op_view(local(p), q) for p, q in items]
        # the group's scalars (α as scheduled) and the direction's own parameters (heavy ball, Lion)
        hyper = dict(group, alpha=group["alpha"] if alpha is None else alpha, spec_direction=pp.direction)
        state = self._stacked.gather(self.state, items)
        if self._needs_closure:
            state["prev"] = torch.stack([local(p).detach() for p, _ in items]).clone()
        post = pp.post
        reads = post_stages.reads(post) if post else set()
        g_raw = None
        if "gradient" in reads:  # the raw gradient, before a direction may overwrite its copy
            g_raw = upcast(stack(g)) if isinstance(g, list) else upcast(g).clone()
        wd = group["weight_decay"]
        rho = group["radius"] * self._scale(pp)
        geometry = pp.geometry
        constraint = pp.constraint
        projects = constraint is not None and gamma * rho != 0
        # in one process the state changes only when the bucket commits (its last request has
        # answered): directions update it out of place (``fresh``), and state updated in place
        # before a request (Adam's moments, post-stages' statistics) is journaled
        atomic = isinstance(self._executor, LocalExecutor) and (geometry["kind"] != "adam" or bool(post) or projects)
        fresh: Optional[list] = [] if atomic else None  # updates the direction puts off until the commit
        if atomic and geometry["kind"] == "adam":  # its moments (d and the stages' state: fresh)
            saved.extend(journal(self._stacked.live(items, state, ("exp_avg", "exp_avg_sq"))))
        commit = None
        if isinstance(g, list) and deferred:
            d, commit = polyak_ahead(g, state, hyper, lambda shape, like: self._lookahead(items, shape, like, False),
                                     fresh=atomic)
        elif isinstance(g, list):
            d = polyak_rows(g, state, hyper, lambda shape, like: self._lookahead(items, shape, like, shared),
                            fresh=fresh)
        else:
            gu = upcast(g)
            # the stacked (or upcast) gradient is this step's own copy: the direction may overwrite it
            d = DIRECTIONS[group["direction"]](gu, state, hyper, g_prev=None if g_prev is None else upcast(g_prev),
                                               inplace=len(items) > 1 or gu is not g, fresh=fresh)
        decay = 1 - gamma * wd
        cautious_decay = wd != 0 and pp.decay == "cautious"
        # unconstrained, parameters in the working dtype: X ← X(1 − γ·wd) − γρ·∇φ₁*(d) in place on
        # the parameters, with no stacked copy of X and no write-back
        inplace = (constraint is None and geometry["kind"] != "adam" and not self.track_update and not cautious_decay
                   and views[0].dtype == upcast(views[0]).dtype)
        # one pass (off torch Muon's op order, :func:`muon_order`; in one process, as the executors
        # exchange results in the input's dtype): the forward op folds a constant radius r into its
        # result S = r·∇φ₁*(d), written in X's dtype, and X.lerp_(S, γ·wd) with r = −ρ/wd is
        # X(1 − γ·wd) − γρ·∇φ₁*(d); without decay X += γ·S with r = −ρ
        one_pass = (inplace and not post and not muon_order(views[0].device)
                    and isinstance(self._executor, LocalExecutor))
        lerp = one_pass and wd != 0 and abs(rho / wd) < 1e30
        radius = (-rho / wd if lerp else -rho) if one_pass else 1.0
        if geometry["kind"] != "adam":
            step, _ = yield self._request(items, d, forward_locality(geometry["kind"]),
                                          self._forward_fn(items, geometry, radius,
                                                           views[0].dtype if one_pass else None))
        if commit is not None:
            commit()
        if post and geometry["kind"] != "adam":
            step = yield from self._post(items, pp, state, step, g_raw, d)
        if inplace:
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
            self._stacked.scatter(self.state, items, state)
            return
        x = upcast(stack(views))
        if geometry["kind"] == "adam" and not post:
            exp_avg, denom, bc1 = adam_moments(d, state, geometry)
            xw = decayed(x, exp_avg, decay, cautious_decay) if wd else x
            y = xw.addcdiv(exp_avg, denom, value=-gamma / bc1)  # AdamW's op order, bit for bit
        else:
            if geometry["kind"] == "adam":  # the adam geometry's update, then the post-stages
                exp_avg, denom, bc1 = adam_moments(d, state, geometry)
                step = yield from self._post(items, pp, state, exp_avg / denom / bc1, g_raw, d)
            # Y = X(1 − γ·wd) − γρ·∇φ₁*(d): ρ folds into the axpy (one pass fewer than scaling the
            # forward output), and the decayed copy of X is updated in place
            if wd:
                y = decayed(x, step, decay, cautious_decay).add_(step, alpha=-gamma * rho)
            else:
                y = torch.add(x, step, alpha=-gamma * rho)
        if projects:  # (a step of length 0 leaves X, feasible, as it is)
            x_new, fallback = yield self._request(
                items, y, backward_locality(geometry["kind"], constraint["kind"]),
                lambda m: backward(m, gamma, geometry, constraint, radius=rho, batch_dims=1))
        else:
            x_new, fallback = y, None
        if fallback is not None:
            counters["fallbacks"] = counters["fallbacks"] + fallback.sum().to(counters["fallbacks"].device)
        if self.track_gap and constraint is not None and gamma * rho > 0:
            state["w"] = (x_new - y) / (gamma * rho)
        if self.track_update and self._first_holder(items[0][0]):  # replicas count their block once
            delta = (x_new - x).reshape(-1)
            counters["update_sq"] = counters["update_sq"] + torch.dot(delta, delta).to(counters["update_sq"].device)
        for update in fresh or ():
            update()
        self._stacked.scatter(self.state, items, state)
        torch._foreach_copy_(views, list(x_new.unbind(0)))

    def _post(self, items: list, pp: ParamPlan, state: dict, u: torch.Tensor, g_raw, d):
        """The rule's post-stages on the bucket's update ``u`` (:mod:`geomopt.optim.stages`), as one
        request (a sub-generator of :meth:`_step_bucket`); their step count is per tensor."""
        step = state.get(post_stages.STAGE_STEP, 0) + 1
        state[post_stages.STAGE_STEP] = step
        shard = None
        p = items[0][0]
        if is_dtensor(p):  # sums over a cut dim are all-reduced by the stages themselves
            layout = self._stacked.layouts[id(p)]
            shard = post_stages.Shard(layout.mine(), layout.cuts, layout.mesh)
        ctx = post_stages.Context(state, pp.op_shape, view=pp.geometry.get("view"), gradient=g_raw,
                                  direction=None if d is None else upcast(d), step=step, shard=shard,
                                  fresh=isinstance(self._executor, LocalExecutor))
        # local on every executor: the stages sum across shards where they need to (Context.sum),
        # the same collectives in the same order on every rank
        out, _ = yield Request(lambda m: (post_stages.run(m, list(pp.post), ctx), None), u, LOCAL)
        if shard is not None:
            self._stacked.reduced[tuple(id(q) for q, _ in items)] = dict(ctx.reduced)
        return out

    def _forward_fn(self, items: list, geometry: dict, radius: float = 1.0, out_dtype=None):
        """The bucket's forward op (``radius``·∇φ₁*, in ``out_dtype``); replayed from a CUDA graph
        (:mod:`geomopt.optim.graphs`) for the polynomial iterations when ``cuda_graphs`` is on and
        the step runs in one process (the graph reads the bucket's kept scratch u in place when
        that is its input)."""
        fn = lambda m: (forward(m, geometry, radius=radius, batch_dims=1, out_dtype=out_dtype), None)  # noqa: E731
        approx = (geometry.get("approx") or {}).get("kind")
        if not (self.cuda_graphs and approx in POLYNOMIAL_APPROXES
                and isinstance(self._executor, LocalExecutor) and items[0][0].is_cuda):
            return fn
        ids = tuple(id(p) for p, _ in items)
        key = ids + (radius, out_dtype)  # the graph bakes both in
        op = self._graphs.get(key)
        if op is None:
            if len(self._graphs) >= 2 * sum(map(len, self._buckets)):
                return fn  # buckets split by missing gradients in many ways: no graph per split
            op = self._graphs[key] = GraphedOp(fn)
        op.scratch = self._buffers.get(ids + ("u",))
        return op

    def _request(self, items: list, x: torch.Tensor, locality: str, fn) -> Request:
        """An operator request for a bucket (sharding read off its first parameter)."""
        p, pp = items[0]
        cost = pp.matrix_cost
        if not is_dtensor(p):
            return Request(fn, x, locality, cost=cost)
        layout = self._stacked.layouts[id(p)]
        if locality == OWNER and whole_matrices(pp.geometry.get("view"), layout.cuts):
            # experts cut whole across ranks: each rank's matrices (the cost: of its share of them)
            share = x[0].numel() / math.prod(pp.op_shape)
            return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape,
                           cost=None if cost is None else cost * share, whole=True)
        return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape, cost=cost)

    def _first_holder(self, p) -> bool:
        """Whether this rank's block of ``p`` is the first copy of it (always, unsharded)."""
        return not is_dtensor(p) or self._stacked.layouts[id(p)].primary(self._executor.rank)

    def _lookahead(self, items: list, shape, like: torch.Tensor, shared: bool) -> torch.Tensor:
        """Where a bucket writes its direction u (in the dtype the forward op casts it to first):
        kept per bucket when a CUDA graph reads it in place; the workspace when the buckets run
        one after another (``shared``); else fresh memory, freed after the step (buckets whose
        steps interleave: distributed rounds, the deferred finiteness test)."""
        dtype = input_dtype(items[0][1].geometry, like)
        if self.cuda_graphs and like.is_cuda:
            return self._stacked.kept(items, "u", shape, like, dtype=dtype)
        if shared:
            return self._workspace.take("u", shape, dtype, like.device)
        return torch.empty(shape, dtype=dtype, device=like.device)


def decayed(x: torch.Tensor, step: torch.Tensor, decay: float, cautious: bool) -> torch.Tensor:
    """X(1 − γλ) (decoupled), or, cautious (Chen et al. 2025), X(1 − γλ) only where the step S and
    X agree in sign (S⊙X ≥ 0) and X elsewhere."""
    if not cautious:
        return x * decay
    return torch.where(step * x >= 0, x * decay, x)
