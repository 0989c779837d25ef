"""The batched variant of a step program (:mod:`geomopt.optim.engine.program`): a bucket's same-shape
tensors stacked, direction → forward op → post-stages → weight decay → backward op, as a
generator of operator requests so the executors (:mod:`geomopt.distributed`) can share a round's
matrix work across ranks."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from geomopt.distributed.executors import Request, is_dtensor
from geomopt.registry import LOCAL
from geomopt.geometry.adam import adam_moments
from geomopt.geometry.prox import backward
from geomopt.geometry.forward import input_dtype
from geomopt.geometry.learned import unchanged_by_step
from geomopt.geometry.operators import backward_locality, forward_locality
from geomopt.optim.units import stages as post_stages
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.directions import DIRECTIONS, polyak_ahead, polyak_rows
from geomopt.optim.engine import fused
from geomopt.optim.engine.writes import axpy_, axpy_rows
from geomopt.optim.engine.atomic import journal, restore
from geomopt.optim.engine.encoded_rows import EncodedMomentum
from geomopt.optim.engine.nonfinite import reads_traces
from geomopt.optim.engine.owned import owned_forward
from geomopt.optim.units.state_keys import COUNTS, geometry_state, owner_state
from geomopt.optim.persist.state_codec import Codec, aligned
from geomopt.optim.engine.tensors import local, op_view, stack, upcast
from geomopt.optim.engine.program import Program
from geomopt.optim.engine.requests import forward_fn, owned_request, request
from geomopt.optim.engine.runtime import Runtime


class BucketJob:
    """One batched step of same-shape tensors (a job of ``prog``'s bucket, leading dim = tensor
    index, batch_dims=1), as phases between its operator requests:

        begin         state gathered, direction d (state put off or journaled), → forward op
        on_forward    Polyak's put-off write; Adam's moments; → post-stages
        on_post       the in-place writes (done), or Y = X(1 − γ·wd) − γρU, → backward op
        on_backward   X⁺ written back, state bound: the job commits

    :meth:`advance` runs the next phase with the previous request's answer ``(out, flags)`` and
    returns the next :class:`Request`, or None when the job is done, so
    :func:`~geomopt.optim.engine.atomic.drive` can hand a round's requests to the executor together
    (locally, or shared out across ranks). No generator: the phases are plain calls, so a
    compiler traces the step whole. :meth:`abort` restores the state the job journaled (one
    process, :mod:`geomopt.optim.engine.atomic`).

    ``g``: the stacked gradients, or a list of them (``prog.direction_form`` rows / ahead);
    ``alpha``: the direction's α as scheduled (None: the group's); ``shared``: the buckets run
    one after another, so this one may use the workspace. Every hyper-parameter is the group's;
    the plan gives the operators and the tensor's radius factor. ``ok`` (a capturable step): the
    device's finiteness flag; every write (parameters, state, step counts) selects the new value
    where it is true and the old one elsewhere, so a skipped step leaves every bit as it was and
    the host never waits."""

    def __init__(self, prog: Program, rt: Runtime, state_of, counters: dict, group: dict, items: list, g, g_prev,
                 gamma: float, alpha, shared: bool = False, ok: Optional[torch.Tensor] = None):
        self.prog, self.rt, self.state_of, self.counters, self.group = prog, rt, state_of, counters, group
        self.items, self.g, self.g_prev, self.gamma, self.alpha, self.shared = items, g, g_prev, gamma, alpha, shared
        self.ok = ok
        # a deferred compiled step's finiteness test: tr A of the iteration's first Gram matrix (fused.folding)
        self.traces: Optional[list] = [] if reads_traces(prog) else None
        # fuse: where the iteration leaves its last product (F, Xₖ, tall), for the write-back to run it
        self.last: Optional[list] = [] if prog.product else None
        # the first factors' range flags (fused.in_range); redo: a matrix out of it, stepped again unfolded
        self.ranges: Optional[list] = [] if reads_traces(prog) else None
        self.redo: Optional[Callable] = None
        self.unfold = False  # set at the deferred barrier (fused.in_ranges)
        self.live: dict = {}
        self.before: dict = {}  # a capturable step: the state as it was, selected where ok is false
        self.saved: list = []  # (live, copy) pairs restored on abort
        self.next: Optional[Callable[[Any], Optional[Request]]] = self.begin

    def advance(self, answer=None) -> Optional[Request]:
        phase = self.next
        self.next = None
        try:
            return phase(answer) if phase is not None else None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        restore(self.saved)
        self.saved = []

    # ------------------------------------------------------------ phases

    def begin(self, _=None) -> Optional[Request]:
        prog, rt, items, group = self.prog, self.rt, self.items, self.group
        pp = self.pp = items[0][1]
        self.views = [op_view(local(p), q) for p, q in items]
        hyper = group if self.alpha is None else dict(group, alpha=self.alpha)
        self.weighted = weighted_state(prog, self.ok)
        if self.weighted and self.ok is not None:  # α·ok: on zeroed gradients d + 0·(0 − d), d as it was
            hyper = dict(hyper, alpha=hyper["alpha"] * self.ok.to(torch.float64))
        # a sharded tensor's kronecker state: on each matrix's owner alone, read there by its forward op
        self.held = owner_state(pp.geometry, is_dtensor(items[0][0]))
        state = self.state = rt.stacked.gather(self.state_of, items, skip=self.held)
        # float32 working copies of state kept in another precision (the rule's, or a checkpoint's);
        # the stored state changes at the commit
        self.codec = codec(rt, items, pp, group["step"])
        self.momentum = EncodedMomentum.take(prog.direction_form, self.codec, state, self.g, hyper, self.ok)
        state = self.state = Codec.decode(state)
        if prog.journal and self.codec.dtype != "float32":
            # a momentum kept float32 (a tensor int8 does not quantize) is what the put-off updates
            # write in place: on a copy here, so that nothing live is written before the encoding
            # of the rest (which allocates, and may fail) has run (:meth:`prepare`)
            for buf in rt.stacked.live(items, state, ("d",)):
                state["d"] = buf.clone()
        if self.ok is not None:  # step counts on the device, and the state as it was
            for key in COUNTS:
                if key in state and (not isinstance(state[key], torch.Tensor) or state[key].device != self.ok.device):
                    state[key] = torch.tensor(int(state[key]), dtype=torch.int64, device=self.ok.device)
            self.live = dict(state)  # the tensors the entries are bound to (written in place at the end)
            self.before = {k: v.clone() for k, v in state.items() if k not in self.weighted}
        else:  # counts as ints while the step computes (host arithmetic); stored as tensors again
            for key in COUNTS:
                if key in state:
                    state[key] = int(state[key])
        if prog.keeps_prev:
            state["prev"] = torch.stack([local(p).detach() for p, _ in items]).clone()
        g, rows, d_journal = fused.rows_calls(prog.compiled, self.ok if prog.direction_form == "rows" else None, pp,
                                             group, state, self.g_prev, self.g)  # G, the look-ahead, d's journal
        self.g_raw = None
        if pp.post and "gradient" in post_stages.reads(pp.post):  # before a direction overwrites its copy
            self.g_raw = upcast(stack(g)) if isinstance(g, list) else upcast(g).clone()
        wd = group["weight_decay"]
        rho = self.rho = group["radius"] * pp.radius_factor
        # a tensor γ (lr read on the device) may be 0: the prox of a step of length 0 is X itself
        self.projects = pp.constraint is not None and rho != 0 and (torch.is_tensor(self.gamma) or self.gamma != 0)
        # in one process the state changes only when the bucket commits (its last request has
        # answered): directions update it out of place (``fresh``), and state updated in place
        # before a request (Adam's moments, post-stages' statistics) is journaled
        self.fresh: Optional[list] = [] if prog.journal else None  # updates put off until the commit
        forward_state = geometry_state(pp.geometry)  # adam's moments, a kronecker method's factors
        if prog.journal:  # the forward op's state, updated in place (d and the stages' state: fresh)
            # (not a kronecker step's roots, bases or PSGD factors between refreshes: it leaves them)
            unchanged = (*COUNTS, *unchanged_by_step(pp.geometry, state))
            kept = tuple(k for k in forward_state if k not in unchanged)
            self.saved.extend(journal(rt.stacked.live(items, state, kept)))
        self.commit = None
        lookahead = lambda shared: lambda shape, like: _lookahead(prog, rt, items, shape, like, shared)  # noqa: E731
        if self.momentum is not None:
            self.d = self.momentum.direction(state, lookahead(self.shared),
                                             fused.lookahead_rows if prog.compiled else None)
        elif prog.direction_form == "ahead" and self.ok is not None and self.fresh is not None:  # capturable:
            self.d, commit = polyak_ahead(g, state, hyper, lookahead(self.shared))  # d in place, put off
            self.fresh.append(commit)
        elif prog.direction_form == "ahead":
            self.d, self.commit = polyak_ahead(g, state, hyper, lookahead(False), fresh=prog.journal)
        elif prog.direction_form == "rows":
            fresh = self.fresh if d_journal is None else None  # d⁺ written in place: nothing put off
            self.d = polyak_rows(g, state, hyper, lookahead(self.shared), fresh=fresh, lookahead_rows=rows)
            self.saved.extend(d_journal or ())  # once the loop has written them
        else:
            gu = upcast(g)
            # the stacked (or upcast) gradient is this step's own copy: the direction may overwrite it
            self.d = DIRECTIONS[group["direction"]].fn(gu, state, hyper, inplace=len(items) > 1 or gu is not g,
                                                       g_prev=None if self.g_prev is None else upcast(self.g_prev),
                                                       fresh=self.fresh)
        # one pass: the forward op folds a constant radius r into its result S = r·∇φ₁*(d), written
        # in X's dtype, and X.lerp_(S, γ·wd) with r = −ρ/wd is X(1 − γ·wd) − γρ·∇φ₁*(d); without
        # decay X += γ·S with r = −ρ
        one_pass = prog.write == "one-pass"
        self.lerp = one_pass and wd != 0 and abs(rho / wd) < 1e30
        radius = (-rho / wd if self.lerp else -rho) if one_pass else 1.0
        self.next = self.on_forward
        if pp.geometry.kind == "adam":
            return self.on_forward(None)
        if self.held:
            out_dtype = self.views[0].dtype if one_pass else None
            return owned_request(rt, items, self.d, owned_forward(self.state_of, items, pp.geometry, self.held,
                                                                  radius, out_dtype, pp.factor_dtype, self.codec.step))
        args = (prog, rt, items, pp.geometry, radius, self.views[0].dtype if one_pass else None,
                state if forward_state else None)
        if self.ranges is not None:  # out of the first factor's range: the same op without it (on_forward)
            self.redo = lambda: forward_fn(*args, last=self.last)
        return request(rt, items, self.d, forward_locality(pp.geometry.kind),
                       forward_fn(*args, traces=self.traces, last=self.last, ranges=self.ranges))

    def on_forward(self, answer) -> Optional[Request]:
        pp = self.pp
        if self.unfold and self.redo is not None:  # a first factor out of range: its op again, unfolded
            if self.last is not None:
                self.last.clear()
            answer = self.redo()(self.d)
        if self.commit is not None:
            self.commit()
        self.x = None
        if pp.geometry.kind == "adam":
            exp_avg, denom, bc1 = adam_moments(self.d, self.state, pp.geometry)
            if not pp.post:
                x = self.x = upcast(stack(self.views))
                wd = self.group["weight_decay"]
                xw = DECAYS[pp.decay].stacked(x, exp_avg, 1 - self.gamma * wd) if wd else x
                if torch.is_tensor(self.gamma):  # lr on the device: γ scales the moment
                    return self.backward(xw.addcdiv(exp_avg * -self.gamma, denom * bc1))
                if isinstance(bc1, torch.Tensor):  # a capturable step's count: bc₁ on the device
                    return self.backward(xw.addcdiv(exp_avg, denom * bc1, value=-self.gamma))
                return self.backward(xw.addcdiv(exp_avg, denom, value=-self.gamma / bc1))  # AdamW's op order
            u = exp_avg / denom / bc1  # the adam geometry's update, then the post-stages
        else:
            u = answer[0]
        self.next = self.on_post
        if not pp.post:
            return self.on_post((u, None))
        return self.post_request(u)

    def on_post(self, answer) -> Optional[Request]:
        step, factor = answer  # factor: the post-stages by rows (fuse), for the compiled write-back
        if self.pp.post and is_dtensor(self.items[0][0]):
            self.rt.stacked.reduced[tuple(id(q) for q, _ in self.items)] = dict(self.post_ctx.reduced)
        gamma, rho, wd = self.gamma, self.rho, self.group["weight_decay"]
        if factor is not None and (self.prog.write == "stacked" or self.lerp):  # no compiled write-back: one pass
            step, factor = step * factor, None
        self.factor = factor
        if self.prog.write != "stacked":  # X ← X(1 − γ·wd) − γρ·∇φ₁*(d) on the parameters themselves
            steps = list(step.unbind(0))
            self.prepare()  # the state's stored form first: a failure there leaves X as it was
            if self.ok is not None and self.prog.compiled and not self.lerp:  # one pass over X, γ·ok
                self.write_compiled(steps, self.ok.to(torch.float64) * gamma)
            elif self.ok is not None:  # γ·ok: a skipped step writes X·1 + 0·S, X itself
                ok = self.ok.to(torch.float64)  # γ·ok rounded as the host's γ is: the eager step's bits
                self.write_scaled(steps, ok * gamma)
            elif self.lerp:
                torch._foreach_lerp_(self.views, steps, gamma * wd)
            else:
                # torch Muon's op order (same bits on CPU): decay, then the axpy of the step (ρ
                # already in it where the forward op folded it)
                coef = gamma if self.prog.write == "one-pass" else -gamma * rho
                if self.prog.compiled:  # one pass over X, with an entrywise prox (optim.engine.fused)
                    self.write_compiled(steps, gamma)
                else:
                    if wd:
                        DECAYS[self.pp.decay].in_place(self.views, 1 - gamma * wd)
                    torch._foreach_add_(self.views, steps, alpha=coef)
            self.bind()
            return None
        # Y = X(1 − γ·wd) − γρ·∇φ₁*(d): ρ folds into the axpy (one pass fewer than scaling the
        # forward output), and the decayed copy of X is updated in place
        decay = DECAYS[self.pp.decay]
        if not (self.prog.track_update or self.prog.track_gap) and decay.into is not None and \
                not torch.is_tensor(gamma) and self.views[0].dtype == step.dtype:  # X read once: no stacked copy
            return self.backward(axpy_rows(self.views, step, decay.into if wd else None, 1 - gamma * wd, -gamma * rho))
        x = self.x = upcast(stack(self.views))
        if wd:
            return self.backward(axpy_(decay.stacked(x, step, 1 - gamma * wd), step,
                                       -gamma * rho))
        if torch.is_tensor(gamma):
            return self.backward(x + step * (-gamma * rho))
        return self.backward(torch.add(x, step, alpha=-gamma * rho))

    def write_compiled(self, steps: list, gamma) -> None:
        """X ← X(1 − γλ) + c·S, c = γ (one-pass) or −γρ, and an entrywise prox where the rule has one,
        in one compiled pass over X (:func:`geomopt.optim.engine.fused.write_back`; γ: a capturable step's γ·ok)."""
        wd, coef = self.group["weight_decay"], gamma if self.prog.write == "one-pass" else -gamma * self.rho
        if self.last:  # the iteration's last product, accumulated into X (steps: the iterate before it)
            held = self.last[0]
            if len(self.last) != 1 or held[1].data_ptr() != steps[0].data_ptr() or len(steps) != held[1].shape[0]:
                raise RuntimeError("the forward op's answer is not the iterate its last product was left for")
            fused.write_product(self.views, held, 1 - gamma * wd, coef)
            return
        fused.write_back(self.views, steps, 1 - gamma * wd, coef, gamma, decay=self.pp.decay, decays=bool(wd),
                         geometry=self.pp.geometry, constraint=self.pp.constraint,
                         rho=self.rho if self.projects else None,
                         factors=None if self.factor is None else list(self.factor.unbind(0)))

    def write_scaled(self, steps: list, gamma) -> None:
        """The in-place writes with γ a 0-d device tensor (a capturable step: γ·ok, or lr on the
        device): per tensor, as ``foreach`` ops would read a tensor's scalar on the host."""
        rho, wd = self.rho, self.group["weight_decay"]
        if self.lerp:
            for v, s in zip(self.views, steps):
                v.lerp_(s, gamma * wd)
            return
        if wd:
            DECAYS[self.pp.decay].in_place(self.views, 1 - gamma * wd)
        coef = gamma if self.prog.write == "one-pass" else -gamma * rho
        for v, s in zip(self.views, steps):
            v.addcmul_(s, coef)

    def backward(self, y: torch.Tensor) -> Optional[Request]:
        """The backward op's request on Y (the prox of the constraint, t = γρ), or its answer at
        once where nothing projects (a step of length 0 leaves X, feasible, as it is)."""
        self.y = y
        self.next = self.on_backward
        if not self.projects:
            return self.on_backward((y, None))
        geometry, constraint, gamma, rho = self.pp.geometry, self.pp.constraint, self.gamma, self.rho
        return request(self.rt, self.items, y, backward_locality(geometry.kind, constraint.kind),
                       lambda m: backward(m, gamma, geometry, constraint, radius=rho, batch_dims=1))

    def on_backward(self, answer) -> Optional[Request]:
        """X⁺ written back with the state and the counters: everything that allocates (the
        selections, the counters' sums, the state's encoding) runs first, then the writes, none of
        which allocates, so an exception (out of memory) leaves the bucket as it found it."""
        x_new, fallback = answer
        counters, prog, in_place = self.counters, self.prog, self.ok is not None
        counts = {}
        if fallback is not None:
            n = fallback.sum() if self.ok is None else fallback.sum() * self.ok
            counts["fallbacks"] = _accumulate(counters["fallbacks"], n, in_place)
        select = self.ok is not None and self.x is not None and (  # else X⁺ selected as it is written
            prog.track_gap or prog.track_update or self.views[0].dtype != x_new.dtype)
        if select:
            x_new = torch.where(self.ok, x_new, self.x)  # type: ignore[arg-type]
        if prog.track_gap and self.pp.constraint is not None and self.rho > 0 and (
                torch.is_tensor(self.gamma) or self.gamma > 0):
            self.state["w"] = (x_new - self.y) / (self.gamma * self.rho)
        if prog.track_update and _first_holder(self.rt, self.items[0][0]):  # replicas count their block once
            delta = (x_new - self.x).reshape(-1)
            counts["update_sq"] = _accumulate(counters["update_sq"], torch.dot(delta, delta), in_place)
        self.prepare()
        counters.update(counts)
        self.bind()
        if self.ok is not None and not select:  # selected as it is written
            for view, row in zip(self.views, x_new.unbind(0)):
                torch.where(self.ok, row, view, out=view)
        else:
            torch._foreach_copy_(self.views, list(x_new.unbind(0)))
        return None

    def prepare(self) -> None:
        """The commit's first half: the direction's put-off updates run and the state takes its
        stored form (:meth:`Codec.encode`, which allocates). Nothing live is written here but the
        put-off updates' in-place writes of float32 state, after which nothing allocates."""
        for update in self.fresh or ():
            update()
        if self.ok is not None:  # selected into the same tensors: the entries stay bound (a compiled step
            for key in self.weighted:  # reads the same objects each step); a weighted key: already its value
                live = self.live.get(key)
                if live is not None and self.state[key] is not live:
                    self.state[key] = live.copy_(self.state[key])
            for key, old in self.before.items():
                live = self.live[key]
                torch.where(self.ok, self.state[key], old, out=live)  # type: ignore[arg-type]
                self.state[key] = live
            for key in COUNTS:  # a count this step created (the state's first step) was 0 before it
                if key in self.state and key not in self.before:
                    self.state[key] = torch.where(self.ok, torch.as_tensor(self.state[key], device=self.ok.device), 0)
        momentum = self.momentum.commit() if self.momentum is not None else {}
        self.state = self.codec.encode(self.state)
        self.state.update(momentum)

    def bind(self) -> None:
        """The commit's second half: the state entries bind to the new rows (no allocation); the
        job lets go of its working state (decoded copies freed before the next bucket steps)."""
        self.rt.stacked.scatter(self.state_of, self.items, self.state)
        self.saved, self.next = [], None
        self.state, self.fresh, self.momentum = {}, None, None

    def post_request(self, u: torch.Tensor) -> Request:
        """The rule's post-stages on the bucket's update ``u`` (:mod:`geomopt.optim.units.stages`), as one
        request, local on every executor: the stages sum across shards where they need to
        (Context.sum), the same collectives in the same order on every rank; their step count is
        per tensor."""
        pp, state, rt = self.pp, self.state, self.rt
        step = state.get(post_stages.STAGE_STEP, 0) + 1
        state[post_stages.STAGE_STEP] = step
        shard = None
        p = self.items[0][0]
        if is_dtensor(p):  # sums over a cut dim are all-reduced by the stages themselves
            layout = rt.stacked.layouts[id(p)]
            shard = post_stages.Shard(layout.mine(), layout.cuts, layout.mesh)
        # X before the step (this rank's block where sharded), for the stages that read it
        param = upcast(stack(self.views)) if "param" in post_stages.reads(pp.post) else None
        ctx = self.post_ctx = post_stages.Context(
            state, pp.op_shape, view=pp.geometry.view, gradient=self.g_raw,
            direction=None if self.d is None else upcast(self.d), param=param, step=step, shard=shard,
            fresh=self.prog.journal)
        # fuse: by rows where the stages can (one read of U), the factor in the write-back
        return Request(lambda m: fused.post_by_rows(m, list(pp.post), ctx, rows=self.prog.compiled), u, LOCAL)


def weighted_state(prog: Program, ok: Optional[torch.Tensor]) -> tuple:
    """The state keys a capturable step (``ok``: the device's finiteness flag) updates with its
    weight scaled by the flag, so a skipped step leaves them as they were with no copy of them
    and no selection: Polyak's d read row by row or ahead (d ← d.lerp(g, α·ok) on gradients zeroed
    where the flag is false, d + 0·(0 − d) = d; the same bits as α where it is true)."""
    return ("d",) if ok is not None and prog.direction_form in ("rows", "ahead") else ()


def codec(rt: Runtime, items: list, pp, step: int) -> Codec:
    """The bucket's :class:`~geomopt.optim.persist.state_codec.Codec`: sharded, where its block lies in the
    whole tensor and whether int8 blocks fit in every rank's shard (the same on every rank)."""
    names = tuple(q.name for _, q in items)
    if pp.state_dtype == "float32" or not is_dtensor(items[0][0]):
        return Codec(pp.state_dtype, names, step, factors=pp.factor_dtype)
    layout = rt.stacked.layouts[id(items[0][0])]
    return Codec(pp.state_dtype, names, step, start=tuple(s for s, _ in layout.mine()), full=tuple(pp.op_shape),
                 aligned=aligned(tuple(pp.op_shape), layout.blocks), factors=pp.factor_dtype)


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


def _accumulate(total: torch.Tensor, value: torch.Tensor, in_place: bool) -> torch.Tensor:
    """total + value; in place for a capturable step (a CUDA graph replays its writes into the
    tensors it captured, so a counter must stay the same tensor)."""
    value = value.to(total.device)
    return total.add_(value) if in_place else total + value
