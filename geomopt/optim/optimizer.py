"""GeomOptimizer: executes a compiled Plan as an ordinary ``torch.optim.Optimizer``.

One param_group per rule; ``lr``, ``weight_decay``, ``radius``, ``alpha`` (the direction's
α = 1 − β) live in the group, so torch LR schedulers, GradScaler and checkpoint tools work
unchanged. Per tensor, one step is (spec → plan → step)::

    d ← direction(g)                      none / Polyak(+Nesterov) / heavy ball / Lion / STORM
    U = post(∇φ₁*(d))                     forward op of the geometry, then the rule's post-stages
    Y = X(1 − γ·wd) − γ·ρ·U               decoupled weight decay (torch's form; cautious: only
                                          where U and X agree in sign) and the step
    X⁺ = backward(Y)                      prox of the constraint (t = γρ)

written back in the parameter's dtype; state (directions, Adam moments) is kept in float32 at
least. γ is the group's ``lr`` shaped by the rule's schedule.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import math
import warnings
from collections import defaultdict
from typing import Callable, Optional, Union

import torch
from torch.optim import Optimizer

from geomopt.compile import as_spec, plan_from_infos
from geomopt.compile.compiler import model_params, needs_roles
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.geometry.backward import backward
from geomopt.geometry.adam import adam_moments
from geomopt.geometry.forward import elementwise_into, forward, input_dtype, isotropic_factors
from geomopt.geometry.spectral import POLYNOMIAL_APPROXES, BF16Warning, muon_order, slow_bf16
from geomopt.optim.directions import DIRECTIONS
from geomopt.distributed import (
    FORWARD_LOCALITY, LOCAL, LocalExecutor, Request, ShardedExecutor, backward_locality, chunk_sizes, is_dtensor,
    make_executor,
)
from geomopt.optim.graphs import GraphedOp
from geomopt.optim.migrate import VIEW_KEYS, MigrationReport, migrate_state, saved_names, source_of, translate
from geomopt.optim import stages as post_stages
from geomopt.optim.schedules import SCHEDULES
from geomopt.optim.workspace import Workspace
from geomopt.spec.model import Spec
from geomopt.spec.printers import dump_spec



def _euclidean(pp: ParamPlan) -> dict:
    """The Euclidean geometry for P_C (project_on_init, the violation): spectral sets act per
    matrix of the plan's ``view``, as the rule's own backward step does."""
    return {"kind": "euclidean", "radius": 1.0, "view": pp.geometry.get("view")}


def spec_hash(spec: Spec) -> str:
    """Content hash of a spec (independent of spelling, comments and file format)."""
    return hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


log = logging.getLogger("geomopt")


class NonFiniteGradientError(FloatingPointError):
    """A non-finite gradient under ``on_nonfinite: raise``; parameters and state are untouched."""


class GeomOptimizer(Optimizer):
    """``GeomOptimizer(model_or_named_parameters, spec)``: spec is a Spec, a path or a dict.

    ``roles``: role → name patterns (``{"head": ["proj_out.weight"]}``), over the roles inferred
    from the model (:mod:`geomopt.compile.roles`) and the spec's ``roles:``. Roles are inferred
    from an ``nn.Module``'s structure, guessed from names and shapes for an iterable of
    (name, tensor), and only where the spec reads them (``match: {role: …}``, ``view: auto``).

    ``track_update``: measure ‖X⁺ − X‖ each step for :meth:`diagnostics` (two passes over
    every tensor: off by default, like the gap).

    ``track_gap``: keep W = (X⁺ − Y)/(γρ) after each step so :meth:`diagnostics` can report the
    stationarity gap against the next gradient (one extra tensor per parameter).

    STORM directions need ``step(closure)``: the closure computes the loss on the current batch
    and calls ``backward()`` (zeroing gradients in it is harmless: the optimizer sets them to None
    before each evaluation); the optimizer evaluates it at the previous iterate and at the current
    one (same batch), except on the first step.

    Non-finite gradients (any group) skip the whole step or raise, per rule (``on_nonfinite``),
    before anything is written.

    ``distributed``: ``"auto"`` (default) runs sharded (FSDP2) when the parameters are DTensors,
    replicated (DDP) when ``torch.distributed`` is initialized with more than one rank, and local
    otherwise; ``"ddp"`` / ``"fsdp"`` insist on one mode, ``False`` opts out. Under DDP each rank
    computes a balanced share of the matrix functions (Newton–Schulz, SVD, polar) and the results
    are all-gathered; under FSDP2 elementwise work stays on the shards, norms are reduced over
    shards and each matrix function runs on one owning rank (:mod:`geomopt.distributed`).
    ``process_group``: the DDP group (default: the world).

    ``cuda_graphs`` (off by default): on CUDA in one process, replay each bucket's Newton–Schulz /
    Polar Express iteration from a CUDA graph captured on its first step (one launch instead of
    ~25; same kernels, same bits). It cuts the host's time per step (GPT-2-small's hidden
    matrices on an H100: 6.7 → 2.0 ms), which pays where the host is the bottleneck (small
    matrices, a slow CPU); each graph keeps a private memory pool of about its bucket's size in
    fp32 (+450 MiB there, for 340 MB of matrices). No effect on CPU, under torch.distributed, or
    while the caller is itself capturing a graph.
    """

    def __init__(self, model_or_named_parameters, spec: Union[Spec, str, dict], *, track_gap: bool = False,
                 track_update: bool = False, distributed: Union[str, bool] = "auto", process_group=None,
                 cuda_graphs: bool = False, roles: Optional[dict] = None):
        self.spec = as_spec(spec)
        infos, tensors = model_params(model_or_named_parameters, needs_roles(self.spec, roles))
        self.plan: Plan = plan_from_infos(self.spec, infos, roles=roles)
        self.spec_hash = spec_hash(self.spec)
        # the model's parameter order (a torch optimizer's state saved without names maps by it)
        self._order = ([i.name for i in infos], [i.name for i in infos if i.requires_grad])
        self.track_gap = track_gap
        self.track_update = track_update
        self.cuda_graphs = cuda_graphs
        self._graphs: dict = {}  # bucket → GraphedOp
        self._flag_host = None  # pinned host copy of the finiteness flag (CUDA)
        groups, self._plans = [], []
        for index, rule in enumerate(self.spec.rules):
            plans = [p for p in self.plan if p.rule_index == index]
            if not plans:
                continue
            first = plans[0]
            d = first.direction
            groups.append(dict(
                params=[tensors[p.name] for p in plans], param_names=[p.name for p in plans], rule=rule.name,
                spec_hash=self.spec_hash, lr=first.lr,
                weight_decay=first.weight_decay, radius=first.geometry["radius"], direction=d["kind"],
                alpha=d.get("alpha", 1.0), nesterov=d.get("nesterov", False), init=d.get("init", "zero"),
                schedule=first.schedule, on_nonfinite=first.on_nonfinite, step=0,
            ))
            self._plans.append(plans)
        self._building = True
        super().__init__(groups, dict(lr=0.02, weight_decay=0.0))
        self._building = False
        # what the spec set per group, saved with the state: after a spec change, values the new
        # spec changed win over the checkpoint's (load_state_dict)
        self._spec_groups = [{k: _copy(g[k]) for k in self._SPEC_KEYS} for g in self.param_groups]
        self._counters = [_new_counters() for _ in self.param_groups]
        # same-(ops, shape, dtype, device) tensors of a group run as one batched call (Plan buckets)
        self._buckets = []
        for plans in self._plans:
            by_key: dict = {}
            for i, pp in enumerate(plans):
                by_key.setdefault(pp.bucket, []).append(i)
            self._buckets.append(list(by_key.values()))
        self._buffers: dict = {}  # (param ids, state key) → stacked state; per-param state holds views
        self._workspace = Workspace()  # a step's scratch, shared by its buckets
        # entries of the largest bucket (what a batched step stacks at once): bounds the flat path's blocks
        self._largest_bucket = max((sum(g["params"][i].numel() for i in b)
                                    for g, bs in zip(self.param_groups, self._buckets) for b in bs), default=1)
        self._executor = make_executor([p for g in self.param_groups for p in g["params"]], distributed, process_group)
        self._sharded = isinstance(self._executor, ShardedExecutor)
        self._replicated: dict = {}  # param ids → stage state keys every rank holds whole (FSDP2)
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)
        self._warn_slow_bf16(tensors)
        self._project_on_init()

    # ------------------------------------------------------------ set-up

    def add_param_group(self, param_group: dict) -> None:
        """Groups come from the spec's rules (one per rule): a group added later would have no
        plan and never step, so it is refused."""
        if not getattr(self, "_building", False):
            raise RuntimeError("GeomOptimizer's param groups are the spec's rules: add a rule to the spec (and "
                               "build a new optimizer) instead of calling add_param_group")
        super().add_param_group(param_group)

    def _warn_slow_bf16(self, tensors: dict) -> None:
        """One warning when rules ask for bf16 matrix iterations on a CPU that emulates bf16."""
        slow = sorted({pp.rule for pp in self.plan if slow_bf16(pp.geometry.get("approx"), tensors[pp.name].device)})
        if slow:
            warnings.warn(
                f"rule(s) {', '.join(map(repr, slow))} of spec '{self.spec.name}' run their matrix iteration in "
                f"bfloat16 on a CPU without native bf16 matmuls, which emulates them: about 100x slower than float32 "
                f"(a 512³ matmul ran at 1.2 against 119 GFLOP/s on an AVX2 CPU), so a step can take seconds. Set the approx's "
                f"dtype to auto (bf16 on CUDA, float32 on CPU) or float32", BF16Warning, stacklevel=3)

    @torch.no_grad()
    def _project_on_init(self) -> None:
        """Project constrained tensors onto their set (geomopt.geometry.backward: feasibility), as Scion's init does,
        so every backward step is defined. A tensor already in the set (within rounding:
        :func:`_in_set`) is left bit for bit as it is, so weights loaded before the optimizer is
        built resume exactly. A sharded tensor is projected whole (on every rank, once) and each
        rank keeps its shard."""
        for group, plans in zip(self.param_groups, self._plans):
            for p, pp in zip(group["params"], plans):
                c = pp.constraint
                if c is None or not pp.project_on_init or c["kind"] == "proximal_decay":
                    continue
                x = _view(_full(p), pp)
                xu = _upcast(x)
                xp, _ = backward(xu, 1.0, _euclidean(pp), c)
                if _in_set(xu, xp, x.dtype):
                    continue  # already feasible (a resumed run's weights): keep every bit
                x.copy_(xp)
                if is_dtensor(p):
                    p.to_local().copy_(_my_shard(_view(x, pp), p))  # _view is its own inverse

    @property
    def work(self):
        """This rank's matrix-function work so far (:class:`~geomopt.distributed.WorkCounter`:
        matrices, FLOPs up to a constant, seconds): under DDP / FSDP2 about 1/world of the total."""
        return self._executor.work

    def _scale(self, pp: ParamPlan) -> float:
        return pp.radius / pp.geometry["radius"]

    # ------------------------------------------------------------ the step

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """One step for every parameter that has a gradient; returns the closure's loss.

        Non-finite gradients are checked in every group before anything is written: under
        ``on_nonfinite: raise`` (of a rule that has one) the step raises, otherwise the whole step
        is skipped and counted in the rules that had them; either way parameters and all
        optimizer state are left exactly as they were."""
        loss = None
        g_prev: dict = {}
        if self._needs_closure:
            if closure is None:
                raise RuntimeError(
                    "this spec uses a storm direction, which evaluates the gradient at the previous and the "
                    "current iterate on the same batch: call opt.step(closure) with a closure that zeroes the "
                    "gradients, computes the loss and calls backward()")
            g_prev = self._previous_gradients(closure)
            self.zero_grad(set_to_none=True)  # a closure that forgets zero_grad must not add g(x_{k-1})
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            jobs = self._jobs()
            grads = [self._job_grads(gi, items, flat, g_prev) for gi, items, flat in jobs]
            prevs = [_stack([_view(_local(g_prev[p]), pp) for p, pp in items])
                     if all(g_prev.get(p) is not None for p, _ in items) else None for _, items, _ in jobs]
            check = self._finite_check(grads, prevs) if jobs else None
            # deferred: the buckets launch their forward ops (reads into scratch) before the host
            # waits for the test, so the device stays busy; nothing is written before the wait
            defer = self._can_defer(jobs, grads)
            if not defer and self._skip_nonfinite(jobs, grads, prevs, check):
                return loss
            schedules, devices = {}, {}
            for gi, items, _ in jobs:
                if gi not in schedules:
                    group = self.param_groups[gi]
                    gamma, alpha = SCHEDULES[group["schedule"]["kind"]](group, group["step"])
                    schedules[gi] = (gamma, _warmed(alpha, group, items[0][1].direction))
                    devices[gi] = items[0][0].device

            def writes() -> bool:
                """Everything that writes at once; False when the step is skipped."""
                if defer and self._skip_nonfinite(jobs, grads, prevs, check):
                    return False
                for gi, device in devices.items():
                    self._counters[gi]["update_sq"] = torch.zeros((), device=device)
                for (gi, items, flat), g in zip(jobs, grads):
                    if flat:
                        self._step_flat(self.param_groups[gi], items, g, *schedules[gi])
                return True

            if not defer:
                writes()
            shared = not defer and isinstance(self._executor, LocalExecutor)  # buckets one after another
            steps = [self._step_bucket(gi, self.param_groups[gi], items, g, gp, *schedules[gi], deferred=defer,
                                       shared=shared)
                     for (gi, items, flat), g, gp in zip(jobs, grads, prevs) if not flat]
            if not self._run(steps, writes if defer else None):
                return loss
            for gi in schedules:
                self.param_groups[gi]["step"] += 1
        return loss

    def _run(self, steps: list, barrier: Optional[Callable[[], bool]] = None) -> bool:
        """Drive the bucket steps (generators that yield operator requests) in lockstep: each
        round's requests go to the executor together, so a distributed executor makes one
        exchange per round, with the same requests in the same order on every rank.
        ``barrier`` runs after the first round (the forward ops); False from it abandons the
        step (False returned). In one process without a barrier there is nothing to exchange or
        wait for: each bucket's step runs to its end before the next starts, so they share the
        workspace and the transients of one bucket are freed before the next is made."""
        if barrier is None and isinstance(self._executor, LocalExecutor):
            for s in steps:
                answer = None
                while True:
                    try:
                        request = s.send(answer)
                    except StopIteration:
                        break
                    answer = self._executor.run([request])[0]
            return True
        pending = [(s, None) for s in steps]
        answers = [None] * len(steps)
        first = True
        while pending or first:
            nxt = []
            for (s, _), answer in zip(pending, answers):
                try:
                    nxt.append((s, s.send(answer)))
                except StopIteration:  # this bucket's step is done
                    pass
            pending = nxt
            answers = self._executor.run([req for _, req in pending]) if pending else []
            if first and barrier is not None and not barrier():
                for s, _ in pending:
                    s.close()
                return False
            first = False
        return True

    def _can_defer(self, jobs: list, grads: list) -> bool:
        """Whether this step may await the finiteness test after launching the forward ops: in
        one process, off torch Muon's op order (CUDA: :func:`muon_order`), and every bucket
        writes nothing before its forward op (direction none, or Polyak read from the gradients
        as :meth:`_polyak_ahead` does; no Adam geometry, no STORM)."""
        if not isinstance(self._executor, LocalExecutor) or self._needs_closure:
            return False
        for (gi, items, flat), g in zip(jobs, grads):
            if flat:
                continue
            group = self.param_groups[gi]
            pp = items[0][1]
            if (muon_order(items[0][0].device) or pp.geometry["kind"] == "adam" or pp.post or pp.decay != "decoupled"
                    or group["direction"] not in ("none", "polyak")
                    or (group["direction"] == "polyak" and not isinstance(g, list))):
                return False
        return True

    def _jobs(self) -> list:
        """(group index, [(param, plan), …], flat) per call: a bucket's tensors that have a
        gradient, split by state history (a tensor that missed steps has its own step counts).
        ``flat``: an elementwise rule's tensors of one dtype and radius, whatever their shapes,
        run as one flat call (:meth:`_step_flat`)."""
        jobs = []
        for gi, (group, plans) in enumerate(zip(self.param_groups, self._plans)):
            flat = self._flat_rule(group, plans[0])
            buckets = [range(len(plans))] if flat else self._buckets[gi]
            for bucket in buckets:
                by_key: dict = {}
                for i in bucket:
                    p = group["params"][i]
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    key = (tuple(sorted(k for k in st if k in _STACKED)),
                           (st.get("adam_step"), st.get(post_stages.STAGE_STEP)))
                    if flat:
                        key += (p.dtype, p.grad.dtype, p.device, self._scale(plans[i]))
                        if not (p.dtype == p.grad.dtype and p.dtype in (torch.float32, torch.float64)):
                            key += (plans[i].bucket,)  # low precision: batched, per bucket
                    by_key.setdefault(key, []).append((p, plans[i]))
                for key, items in by_key.items():
                    ok = flat and key[2] == key[3] and key[2] in (torch.float32, torch.float64)
                    jobs.append((gi, items, ok))
        return jobs

    def _job_grads(self, gi: int, items: list, flat: bool, g_prev: dict):
        """A job's gradients: stacked (batched ops), or a list (views, no copy) where the flat
        path or a Polyak direction reads them tensor by tensor (:meth:`_polyak_rows`)."""
        grads = [_view(_local(p.grad), pp) for p, pp in items]
        group = self.param_groups[gi]
        if flat or (group["direction"] == "polyak" and not g_prev and grads[0].dtype in (torch.float32, torch.float64)
                    and all(g.dtype == grads[0].dtype for g in grads)):
            return grads
        return _stack(grads)

    def _polyak_rows(self, gs: list, state: dict, group: dict, items: list, shared: bool) -> torch.Tensor:
        """Polyak momentum (:func:`geomopt.optim.directions.polyak`, same arithmetic) read from
        the unstacked gradients: d ← d.lerp(g, α) row by row into the stacked state, and with
        Nesterov u = g.lerp(d, 1 − α) written into a scratch (:meth:`_lookahead`; no copy of G)."""
        alpha = group["alpha"]
        d = state.get("d")
        if d is None:
            if group["init"] == "gradient":
                d = state["d"] = torch.stack(gs)
                return d  # d⁰ = g⁰ (Nesterov: g.lerp(g, ·) = g)
            d = state["d"] = torch.zeros((len(gs), *gs[0].shape), dtype=gs[0].dtype, device=gs[0].device)
        torch._foreach_lerp_(list(d.unbind(0)), gs, alpha)
        if not group["nesterov"]:
            return d
        # u in the dtype the forward op casts it to first (bf16 for Newton–Schulz on CUDA): the
        # lerp rounds once into it, so the cast pass is saved and the bits are the same
        u = self._lookahead(items, d.shape, d, shared)
        for i, g in enumerate(gs):
            torch.lerp(g, d[i], 1 - alpha, out=u[i])
        return u

    def _polyak_ahead(self, gs: list, state: dict, group: dict, items: list) -> tuple:
        """:meth:`_polyak_rows` with the write of d put off, for :meth:`_can_defer`: the gradients
        are stacked once (a transient copy, one launch instead of one per tensor: on an H100 the
        step is bound by the host's launches, measured 5% faster), u is read from them and the
        old d into a scratch (:meth:`_lookahead`, in the forward op's dtype), and the returned ``commit()``
        writes d ← d.lerp(g, α) later. Without Nesterov u = d.lerp(g, α) (the new d); with it
        g.lerp(d⁺, 1 − α) = β²d + (1 − β²)g, β = 1 − α, read as d.lerp(g, 1 − β²) (the same
        value, rounded once)."""
        alpha, nesterov = group["alpha"], group["nesterov"]
        g = _stack(gs)
        u = self._lookahead(items, g.shape, g, False)
        d = state.get("d")
        if d is None and group["init"] == "gradient":  # d⁰ = g⁰, and with Nesterov u = g too
            u.copy_(g)
            return u, lambda: state.__setitem__("d", g.clone() if len(gs) == 1 else g)
        weight = 1 - (1 - alpha) ** 2 if nesterov else alpha
        if d is None:  # d = 0
            torch.mul(g, weight, out=u)
        else:
            torch.lerp(d, g, weight, out=u)

        def commit():
            if state.get("d") is None:
                state["d"] = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
            state["d"].lerp_(g, alpha)

        return u, commit

    def _flat_rule(self, group: dict, pp: ParamPlan) -> bool:
        """A rule whose whole step is elementwise (φ euclidean, anisotropic or adam; isotropic
        needs one norm per tensor), with no constraint, no STORM and nothing tracked: its tensors
        need no stacking."""
        kinds = ("euclidean", "anisotropic", "adam") + (() if self._sharded else ("isotropic",))  # isotropic: whole-tensor norm
        return (pp.geometry["kind"] in kinds and pp.constraint is None and not pp.post and pp.decay == "decoupled"
                and group["direction"] in ("none", "polyak") and not self.track_gap and not self.track_update)

    def _step_flat(self, group: dict, items: list, grads: list, gamma: float, alpha) -> None:
        """One step of an elementwise rule with foreach kernels: the state lives in flat buffers
        (per-parameter state entries are views of them), the forward map runs on flat memory, and
        the parameters are updated in place. Same arithmetic as :meth:`_step_bucket`, so the same
        bits, except adam on devices with a fused AdamW kernel (:meth:`_adam_update`:
        torch.optim.AdamW(fused=True)'s bits there).

        u (the direction the map reads) is the gradients or the momentum themselves where the map
        only reads it, and then the step is one pass of each op over all tensors. Where something
        is written besides the state and the parameters (Nesterov's look-ahead, the sign map's
        output, unfused Adam's denominator) the whole step runs block by block
        (:func:`_blocks`: row ranges of at most :data:`BLOCK` entries, and of the largest
        bucket at most): each block's momentum, map and update follow each other while the block
        is in cache, and the scratch is one block of the workspace. Every op is elementwise, so
        blocks change no bit."""
        pp = items[0][1]
        geometry, kind = pp.geometry, pp.geometry["kind"]
        alpha = group["alpha"] if alpha is None else alpha
        wd = group["weight_decay"]
        scale = -gamma * group["radius"] * self._scale(pp)
        xs = [_view(_local(p), q) for p, q in items]
        gs = grads  # operators' layout already (_job_grads)
        d = ds = None
        lerp = nesterov = False
        if group["direction"] != "none":
            first = "d" not in self.state[items[0][0]]
            d, ds = self._flat_state(items, xs, "d")
            if first and group["init"] == "gradient":
                torch._foreach_copy_(ds, gs)  # d⁰ = g⁰ (and with Nesterov u = g.lerp(g, ·) = g)
            else:
                lerp, nesterov = True, group["nesterov"]
        adam = self._adam_state(items, xs) if kind == "adam" else None
        fused = adam is not None and _fused_adam(xs, gs if ds is None else ds)
        writes = nesterov or kind == "anisotropic" or (adam is not None and not fused)
        if not writes:
            blocks = [(None, 0, d.numel() if d is not None else None)]
        else:  # isotropic reads whole tensors (a norm each): blocks of whole tensors
            blocks = _blocks(xs, min(self._largest_bucket, BLOCK) if kind != "isotropic" else self._largest_bucket,
                             rows=kind != "isotropic")
        take = functools.partial(self._workspace.take, dtype=xs[0].dtype, device=xs[0].device)
        for pieces, off, n in blocks:
            cut = (lambda ts: ts) if pieces is None else functools.partial(_cut, pieces=pieces)
            x_b, g_b = cut(xs), cut(gs)
            d_b = None if d is None else cut(ds)
            if lerp:
                torch._foreach_lerp_(d_b, g_b, alpha)
            if nesterov or (kind == "anisotropic" and d is None):
                u = take("u", (n,))
                u_views = _split_like(u, x_b)
                torch._foreach_copy_(u_views, g_b)
                if nesterov:
                    u.lerp_(d[off:off + n], 1 - alpha)  # g.lerp(d, 1 − α), as the batched path
            elif d is not None:
                u, u_views = d[off:off + n], d_b
            else:
                u, u_views = None, g_b
            if adam is not None:
                self._adam_update(x_b, u_views, *adam, pieces, off, geometry, gamma, wd, fused, take)
                continue
            if kind == "isotropic":
                # ρ·(h*)'(‖D‖)/‖D‖·D per tensor (forward.isotropic), the factor applied in the axpy
                factors = isotropic_factors(torch.stack(torch._foreach_norm(u_views)), geometry)
                if wd:
                    torch._foreach_mul_(x_b, 1 - gamma * wd)
                torch._foreach_addcmul_(x_b, u_views, list(factors.unbind(0)), value=scale)
                continue
            steps = u_views
            if kind == "anisotropic":
                out = u if nesterov or d is None else take("u", (u.numel(),))  # in place over a scratch u
                elementwise_into(u, geometry, out)
                steps = _split_like(out, x_b)
            if wd:
                torch._foreach_mul_(x_b, 1 - gamma * wd)
            torch._foreach_add_(x_b, steps, alpha=scale)

    def _adam_state(self, items: list, xs: list) -> tuple:
        """The flat Adam moments of a flat call (buffers and their per-tensor views) and the step
        number this step takes (the count is per parameter; a flat call's tensors share it,
        :meth:`_jobs`)."""
        step = self.state[items[0][0]].get("adam_step", 0) + 1
        m = self._flat_state(items, xs, "exp_avg")
        v = self._flat_state(items, xs, "exp_avg_sq")
        for p, _ in items:
            self.state[p]["adam_step"] = step
        return m, v, step

    def _adam_update(self, xs, us, m, v, step, pieces, off, geometry, gamma, weight_decay, fused, take) -> None:
        """AdamW's update of ``xs`` (a block's ``pieces`` of the flat call, from ``off`` in the
        flat moments ``m``, ``v``, each a (buffer, views) pair; all of it when ``pieces`` is None): torch's fused AdamW kernel
        where :func:`_fused_adam` allows it (torch.optim.AdamW(fused=True) bit for bit: one pass
        instead of eight), else :func:`geomopt.geometry.adam.adam_moments`'s op order (AdamW's
        single-tensor path, bit for bit) with the denominator in the workspace."""
        beta1, beta2 = (float(b) for b in geometry.get("betas", (0.9, 0.999)))
        eps = float(geometry.get("eps", 1e-8))
        (m, m_views), (v, v_views) = m, v
        if pieces is not None:
            n = sum(x.numel() for x in xs)
            m, v = m[off:off + n], v[off:off + n]
            m_views, v_views = _split_like(m, xs), _split_like(v, xs)
        if fused:
            steps = [torch.full((), step, dtype=torch.float32, device=xs[0].device)] * len(xs)  # read, not written
            torch._fused_adamw_(xs, us, m_views, v_views, [], steps, lr=gamma, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
            return
        torch._foreach_lerp_(m_views, us, 1 - beta1)
        v.mul_(beta2)
        torch._foreach_addcmul_(v_views, us, us, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = take("denom", v.shape)
        torch.sqrt(v, out=denom).div_(bias_correction2_sqrt).add_(eps)
        if weight_decay:
            torch._foreach_mul_(xs, 1 - gamma * weight_decay)
        torch._foreach_addcdiv_(xs, m_views, _split_like(denom, xs), value=-gamma / bias_correction1)

    def _kept(self, items: list, name: str, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """A scratch buffer kept across steps for this call's tensors, for a CUDA graph that reads
        it in place (:meth:`_forward_fn`); its contents are the caller's to overwrite."""
        key = tuple(id(p) for p, _ in items) + (name,)
        dtype = like.dtype if dtype is None else dtype
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=like.device)
        return buf

    def _lookahead(self, items: list, shape, like: torch.Tensor, shared: bool) -> torch.Tensor:
        """Where a bucket writes its direction u (in the dtype the forward op casts it to first):
        kept per bucket when a CUDA graph reads it in place; the workspace when the buckets run
        one after another (``shared``); else fresh memory, freed after the step (buckets whose
        steps interleave: distributed rounds, the deferred finiteness test)."""
        dtype = input_dtype(items[0][1].geometry, like)
        if self.cuda_graphs and like.is_cuda:
            return self._kept(items, "u", shape, like, dtype=dtype)
        if shared:
            return self._workspace.take("u", shape, dtype, like.device)
        return torch.empty(shape, dtype=dtype, device=like.device)

    def _flat_state(self, items: list, xs: list, key: str) -> tuple:
        """The flat buffer of state ``key`` for a flat call and its per-parameter views (rebuilt
        when the entries are not its views: first step, or after load_state_dict)."""
        ids = tuple(id(p) for p, _ in items) + ("flat", key)
        buf = self._buffers.get(ids)
        entries = [self.state[p].get(key) for p, _ in items]
        if buf is not None and all(e is not None for e in entries):
            rows = [_state_row(e, pp, key) for e, (_, pp) in zip(entries, items)]
            if all(r._base is buf for r in rows):
                return buf, rows
        buf, views = _flat_like(xs)
        if all(e is not None for e in entries):
            torch._foreach_copy_(views, [_state_row(e, pp, key) for e, (_, pp) in zip(entries, items)])
        else:
            buf.zero_()
        self._buffers[ids] = buf
        for v, (p, pp) in zip(views, items):
            self.state[p][key] = _state_entry(v, p, pp, key)
        return buf, views

    def _finite_check(self, grads: list, prevs: list):
        """Launch the fast test of :meth:`_skip_nonfinite` (a sum is finite iff every entry is,
        unless it overflows); on CUDA its flag is copied to pinned host memory behind an event,
        so the host can launch more work before it waits."""
        ok = self._finite_flags(grads, prevs, _sum_finite).all()
        if not ok.is_cuda:
            return ok, None
        if self._flag_host is None:
            self._flag_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._flag_host.copy_(ok, non_blocking=True)  # on ok's device's current stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ok.device))  # which need not be the current device
        return self._flag_host, event

    def _skip_nonfinite(self, jobs: list, grads: list, prevs: list, check) -> bool:
        """True (and counted) when some gradient is non-finite; raises first where a rule says so.

        Waits for :meth:`_finite_check` (one host sync per step); only when some sum is not finite
        are those tensors checked entry by entry (so huge finite gradients still step)."""
        if check is None:
            return False
        flag, event = check
        if event is not None:
            event.synchronize()
        if bool(flag):
            return False
        ok = self._finite_flags(grads, prevs, _finite)
        if bool(ok.all()):
            return False
        bad: dict = {}
        for (gi, items, _), flag in zip(jobs, ok.tolist()):
            if not flag:
                bad.setdefault(gi, []).extend(pp.name for _, pp in items)
        for gi, names in bad.items():
            group = self.param_groups[gi]
            if group["on_nonfinite"] == "raise":
                raise NonFiniteGradientError(
                    f"non-finite gradient in rule '{group['rule']}' for {', '.join(names[:5])}"
                    + (" …" if len(names) > 5 else "")
                    + "; parameters and optimizer state are unchanged (set on_nonfinite: skip to skip such steps)")
        for gi in bad:
            self._counters[gi]["skipped"] += 1
        return True

    def _finite_flags(self, grads: list, prevs: list, test) -> torch.Tensor:
        flags = [test(g) if gp is None else test(g) & test(gp) for g, gp in zip(grads, prevs)]
        return self._executor.all_finite(torch.stack([f.to(flags[0].device) for f in flags]))

    def _previous_gradients(self, closure) -> dict:
        """g(x_{k−1}, ξ_k) for STORM: swap in the previous iterate, evaluate, swap back. Tensors
        without a previous iterate (first step, or never had a gradient) stay at the current one
        and get d = g on their first step (no second evaluation when no tensor has one)."""
        params = [p for g in self.param_groups for p in g["params"] if "prev" in self.state[p]]
        if not params:
            return {}  # first step: d⁰ = g(x₀, ξ₀), no second evaluation
        with torch.no_grad():
            current = [p.detach().clone() for p in params]
            for p in params:
                p.copy_(self.state[p]["prev"])
        try:
            self.zero_grad(set_to_none=True)
            with torch.enable_grad():
                closure()
            out = {p: (p.grad.detach().clone() if p.grad is not None else None) for p in params}
        finally:
            with torch.no_grad():
                for p, x in zip(params, current):
                    p.copy_(x)
        return out

    def _step_bucket(self, gi: int, group: dict, items: list, g: torch.Tensor, g_prev, gamma: float, alpha,
                     deferred: bool = False, shared: bool = False):
        """One batched step of same-shape tensors: leading dim = tensor index (batch_dims=1).

        A generator: it yields a :class:`Request` for the forward and for the backward operator
        and receives ``(out, flags)``, so :meth:`_run` can hand a round's operators to the
        executor together (locally, or shared out across ranks). ``deferred``: write nothing
        before the first yield (:meth:`_can_defer`); ``shared``: the buckets run one after another
        (:meth:`_run`), so this one may use the workspace."""
        counters = self._counters[gi]
        pp = items[0][1]
        views = [_view(_local(p), q) for p, q in items]
        hyper = dict(group, alpha=alpha) if alpha is not None else dict(group)
        hyper["spec_direction"] = pp.direction  # the direction's own parameters (heavy ball, Lion)
        state = self._gather(items)
        if self._needs_closure:
            state["prev"] = torch.stack([_local(p).detach() for p, _ in items]).clone()
        post = pp.post
        reads = post_stages.reads(post) if post else set()
        g_raw = None
        if "gradient" in reads:  # the raw gradient, before a direction may overwrite its copy
            g_raw = _upcast(_stack(g)) if isinstance(g, list) else _upcast(g).clone()
        commit = None
        if isinstance(g, list) and deferred:
            d, commit = self._polyak_ahead(g, state, hyper, items)
        elif isinstance(g, list):
            d = self._polyak_rows(g, state, hyper, items, shared)
        else:
            gu = _upcast(g)
            # the stacked (or upcast) gradient is this step's own copy: the direction may overwrite it
            d = DIRECTIONS[group["direction"]](gu, state, hyper, g_prev=None if g_prev is None else _upcast(g_prev),
                                               inplace=len(items) > 1 or gu is not g)
        wd = group["weight_decay"]
        decay = 1 - gamma * wd
        cautious_decay = wd != 0 and pp.decay == "cautious"
        rho = group["radius"] * self._scale(pp)
        geometry = pp.geometry
        constraint = pp.constraint
        # unconstrained, parameters in the working dtype: X ← X(1 − γ·wd) − γρ·∇φ₁*(d) in place on
        # the parameters, with no stacked copy of X and no write-back
        inplace = (constraint is None and geometry["kind"] != "adam" and not self.track_update and not cautious_decay
                   and views[0].dtype == _upcast(views[0]).dtype)
        # one pass (off torch Muon's op order, :func:`muon_order`; in one process, as the executors
        # exchange results in the input's dtype): the forward op folds a constant radius r into its
        # result S = r·∇φ₁*(d), written in X's dtype, and X.lerp_(S, γ·wd) with r = −ρ/wd is
        # X(1 − γ·wd) − γρ·∇φ₁*(d); without decay X += γ·S with r = −ρ
        one_pass = (inplace and not post and not muon_order(views[0].device)
                    and isinstance(self._executor, LocalExecutor))
        lerp = one_pass and wd != 0 and abs(rho / wd) < 1e30
        radius = (-rho / wd if lerp else -rho) if one_pass else 1.0
        if geometry["kind"] != "adam":
            step, _ = yield self._request(items, d, FORWARD_LOCALITY[geometry["kind"]],
                                          self._forward_fn(items, geometry, radius, views[0].dtype if one_pass else None))
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
            self._scatter(items, state)
            return
        x = _upcast(_stack(views))
        if geometry["kind"] == "adam" and not post:
            exp_avg, denom, bc1 = adam_moments(d, state, geometry)
            xw = _decayed(x, exp_avg, decay, cautious_decay) if wd else x
            y = xw.addcdiv(exp_avg, denom, value=-gamma / bc1)  # AdamW's op order, bit for bit
        else:
            if geometry["kind"] == "adam":  # the adam geometry's update, then the post-stages
                exp_avg, denom, bc1 = adam_moments(d, state, geometry)
                step = yield from self._post(items, pp, state, exp_avg / denom / bc1, g_raw, d)
            # Y = X(1 − γ·wd) − γρ·∇φ₁*(d): ρ folds into the axpy (one pass fewer than scaling the
            # forward output), and the decayed copy of X is updated in place
            if wd:
                y = _decayed(x, step, decay, cautious_decay).add_(step, alpha=-gamma * rho)
            else:
                y = torch.add(x, step, alpha=-gamma * rho)
        if constraint is not None:
            x_new, fallback = yield self._request(
                items, y, backward_locality(geometry["kind"], constraint["kind"]),
                lambda m: backward(m, gamma, geometry, constraint, radius=rho, batch_dims=1))
        else:
            x_new, fallback = y, None
        if fallback is not None:
            counters["fallbacks"] = counters["fallbacks"] + fallback.sum().to(counters["fallbacks"].device)
        if self.track_gap and constraint is not None and gamma * rho > 0:
            state["w"] = (x_new - y) / (gamma * rho)
        if self.track_update:
            delta = (x_new - x).reshape(-1)
            counters["update_sq"] = counters["update_sq"] + torch.dot(delta, delta).to(counters["update_sq"].device)
        self._scatter(items, state)
        torch._foreach_copy_(views, list(x_new.unbind(0)))

    def _post(self, items: list, pp: ParamPlan, state: dict, u: torch.Tensor, g_raw, d):
        """The rule's post-stages on the bucket's update ``u`` (:mod:`geomopt.optim.stages`), as one
        request (a sub-generator of :meth:`_step_bucket`); their step count is per tensor."""
        step = state.get(post_stages.STAGE_STEP, 0) + 1
        state[post_stages.STAGE_STEP] = step
        shard = None
        p = items[0][0]
        if is_dtensor(p):  # sums over a cut dim are all-reduced by the stages themselves
            dim = _op_shard_dim(p, pp)
            sizes = chunk_sizes(pp.op_shape[dim], p.device_mesh.size())
            rank = p.device_mesh.get_local_rank()
            shard = post_stages.Shard(dim + 1, sum(sizes[:rank]), sizes[rank], self._executor.group)
        ctx = post_stages.Context(state, pp.op_shape, view=pp.geometry.get("view"), gradient=g_raw,
                                  direction=None if d is None else _upcast(d), step=step, shard=shard)
        # local on every executor: the stages sum across shards where they need to (Context.sum),
        # the same collectives in the same order on every rank
        out, _ = yield Request(lambda m: (post_stages.run(m, list(pp.post), ctx), None), u, LOCAL)
        if shard is not None:
            self._replicated[tuple(id(q) for q, _ in items)] = set(ctx.replicated)
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
        dim = p.placements[0].dim % p.ndim
        if pp.transpose and dim < 2:
            dim = 1 - dim
        full = tuple(_view(torch.empty(p.shape, device="meta"), pp).shape)
        return Request(fn, x, locality, shard_dim=dim + 1, full_shape=full, mesh=p.device_mesh, cost=cost)

    def _gather(self, items: list) -> dict:
        """The state of a batched call: stacked tensors (the per-parameter state entries are views
        of them, so nothing is copied in steady state) and the shared step count."""
        first = self.state[items[0][0]]
        ids = tuple(id(p) for p, _ in items)
        out = {}
        for key in _STACKED:
            if key not in first:
                continue
            buf = self._buffers.get((ids, key))
            rows = [_state_row(self.state[p][key], pp, key) for p, pp in items]
            if buf is None or any(e._base is not buf or e.data_ptr() != buf[i].data_ptr() for i, e in enumerate(rows)):
                # first use, or state replaced (load_state_dict): restack, in the memory layout a
                # step gives it (a lone tensor keeps its own, e.g. transposed), so that reductions
                # sum in the same order and a resumed run matches bit for bit
                buf = _stack(rows).clone()
            out[key] = buf
        for key in ("adam_step", post_stages.STAGE_STEP):
            if key in first:
                out[key] = first[key]
        return out

    def _scatter(self, items: list, state: dict) -> None:
        """Bind the per-parameter state entries to rows of the stacked state (DTensors over the
        rows for sharded parameters, laid out like the parameter)."""
        ids = tuple(id(p) for p, _ in items)
        whole = self._replicated.get(ids, ())
        for key, value in state.items():
            if key in _STACKED:
                if self._buffers.get((ids, key)) is value and all(
                        _state_row(self.state[p][key], pp, key)._base is value for p, pp in items):
                    continue
                self._buffers[(ids, key)] = value
                for i, (p, pp) in enumerate(items):
                    self.state[p][key] = _state_entry(value[i], p, pp, key, key in whole)
            else:
                for p, _ in items:
                    self.state[p][key] = value

    # ------------------------------------------------------------ diagnostics

    @torch.no_grad()
    def diagnostics(self, *, gap_reference: str = "auto") -> dict[str, dict]:
        """Per rule: ``gap`` (stationarity-gap estimate, W of the last step paired with the current
        gradient, :func:`geomopt.geometry.gap.stationarity_gap`; None where undefined or not
        tracked; NaN while a gradient is non-finite; +∞ where W left dom φ₁), ``gap_note`` (None
        where ``gap`` is a finite sum over all the rule's tensors, else why not, naming the rule and
        what to look at instead), ``dual_norm`` (ρ‖G‖_* where g ≡ 0),
        ``violation`` (max distance of a tensor to its constraint set), ``update_norm`` (of the last
        step), ``skipped`` and ``fallbacks`` (steps where the backward step was undefined and the
        Euclidean projection was used). ``gap_reference``: ``"auto"`` (default), ``"declared"`` or
        ``"realized"``, the reference Newton–Schulz / Polar Express rules are measured against
        (:mod:`geomopt.geometry.gap`). Syncs with the device: call it every N steps."""
        from geomopt.geometry.gap import dual_norm, gap_unavailable, stationarity_gap

        def note(rule, pp, why, gap, measured, outside, unpaired):
            """A rule's ``gap_note``: None where its gap is a finite sum over all its tensors."""
            head = f"rule {rule!r} ({pp.geometry['kind']} geometry): "
            if pp.geometry["kind"] != "adam" and pp.constraint is None:
                return head + "no constraint (g ≡ 0): the gap of the lmo method is ρ‖G‖_*, reported as dual_norm"
            if why is not None:
                return head + why
            if not self.track_gap:
                return head + "not tracked: GeomOptimizer(..., track_gap=True) keeps the W of each step for the gap"
            if gap is not None and math.isnan(gap):
                return head + "a gradient is non-finite (the step is skipped): no estimate"
            if gap is None and not unpaired:
                return head + "no gradient: the gap pairs the current gradient with the W of the last step"
            if gap is None:
                return head + "no W yet: the gap pairs the W of the last step with the current gradient"
            if outside:
                return head + (f"W of the last step lies outside dom φ₁ for {outside} of {measured} tensor(s), so "
                               "the Fenchel–Young gap is +∞: the barrier step was undefined there and fell back to "
                               "the Euclidean projection (see fallbacks; e.g. a Newton–Schulz / Polar Express "
                               "forward whose singular values overshoot 1)")
            if unpaired:
                return head + (f"the sum over {measured} of {measured + unpaired} tensors: the others have a "
                               "gradient but no W from the last step")
            return None

        out = {}
        for group, plans, counters in zip(self.param_groups, self._plans, self._counters):
            gap = dual = None
            violation = 0.0
            first = plans[0]
            why = gap_unavailable(first.geometry, first.constraint, gap_reference)
            measured = outside = unpaired = 0  # tensors: with a gap value, +∞ among them, gradient but no W
            for p, pp in zip(group["params"], plans):
                rho = group["radius"] * self._scale(pp)
                g = None if p.grad is None else _upcast(_view(_full(p.grad), pp))
                if pp.constraint is not None and pp.constraint["kind"] != "proximal_decay":
                    x = _upcast(_view(_full(p), pp))
                    xp, _ = backward(x, 1.0, _euclidean(pp), pp.constraint)
                    violation = max(violation, float((x - xp).norm()))
                if g is None:
                    continue
                w = self.state[p].get("w")
                if w is not None and is_dtensor(w):
                    w = _view(_full(w), pp)
                lmo_gap = pp.constraint is None and pp.geometry["kind"] != "adam"
                if not bool(torch.isfinite(g).all()):
                    # a non-finite gradient (a skipped step): no estimate, and no SVD of it
                    if lmo_gap:
                        dual = math.nan
                    elif w is not None:
                        gap = math.nan
                elif lmo_gap:
                    # g ≡ 0: the gap of the lmo method is ρ‖G‖_*
                    dual = (dual or 0.0) + rho * float(dual_norm(g, pp.geometry))
                elif w is not None:
                    val = stationarity_gap(g, w, pp.geometry, constraint=pp.constraint, reference=gap_reference,
                                           radius=rho)
                    if val is not None:
                        gap = (gap or 0.0) + float(val)
                        measured += 1
                        outside += math.isinf(float(val))
                elif pp.constraint is not None:
                    unpaired += 1
            update_sq = counters["update_sq"]
            if self._sharded:  # each rank holds the squared norm of its shards' update
                update_sq = update_sq.clone()
                self._executor.dist.all_reduce(update_sq, group=self._executor.group)
            out[group["rule"]] = dict(
                gap=gap, gap_note=note(group["rule"], first, why, gap, measured, outside, unpaired),
                dual_norm=dual, violation=violation,
                update_norm=float(update_sq) ** 0.5 if self.track_update else None, skipped=counters["skipped"],
                fallbacks=int(counters["fallbacks"]),
            )
        return out

    # ------------------------------------------------------------ checkpoints

    # Group keys a spec sets (the rest, e.g. ``step`` or a scheduler's ``initial_lr``, is progress).
    _SPEC_KEYS = ("rule", "lr", "weight_decay", "radius", "direction", "alpha", "nesterov", "init", "schedule",
                  "on_nonfinite")

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["geomopt"] = dict(
            spec_hash=self.spec_hash, spec=dump_spec(self.spec, "yaml"),
            world_size=self._executor.world, sharded=self._sharded,
            counters=[_copy_counters(c) for c in self._counters],
            spec_groups=[dict(g) for g in self._spec_groups],
            transposed=[pp.name for plans in self._plans for pp in plans if pp.transpose],
        )
        return sd

    def load_state_dict(self, state_dict: dict, *, allow_spec_change: bool = False,
                        model=None) -> Optional[MigrationReport]:
        """Load a checkpoint; refuses one saved under a different spec (saying what differs)
        unless ``allow_spec_change=True``.

        Under the same spec the state resumes as torch does, bit for bit. Under another spec it
        is carried over by parameter name (:mod:`geomopt.optim.migrate`): each tensor keeps the
        kinds of state (Adam moments, momentum) its new rule uses where the shapes still fit, the
        rest is reset, and the returned :class:`MigrationReport` (also logged) says which. Groups
        are matched by rule name: a value the new spec sets differently (lr, weight_decay, radius,
        direction, …) follows the new spec; a value it leaves alone resumes as saved (e.g. an lr
        a scheduler changed). The ``state_dict()`` of ``torch.optim.AdamW``, ``Adam`` and ``Muon``
        loads the same way (``allow_spec_change=True``); ``model``: the model that optimizer was
        built on, when it was given ``model.parameters()`` (no names) and is not this optimizer's
        model. Nothing is changed when loading fails."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            state_dict = state_dict if out is None else out
        source = source_of(state_dict)
        meta = state_dict.get("geomopt")
        if source != "geomopt":
            if not allow_spec_change:
                raise ValueError(
                    f"this is the state of {'torch.optim.Muon' if source == 'muon' else 'torch.optim.Adam(W)'}, "
                    f"not of a geomopt spec: pass allow_spec_change=True to carry its state over by parameter name "
                    f"(load_state_dict returns what was kept and reset)")
            return self._migrate(state_dict, source, None, model)
        if meta is None:
            # torch.distributed.checkpoint keeps only "state" and "param_groups": the groups carry the hash
            meta = dict(spec_hash=state_dict["param_groups"][0]["spec_hash"])
        if meta["spec_hash"] != self.spec_hash and not allow_spec_change:
            if "spec" in meta:
                diff = difflib.unified_diff(meta["spec"].splitlines(), dump_spec(self.spec, "yaml").splitlines(),
                                            "saved spec", "current spec", lineterm="", n=1)
                saved = f"'{_spec_name(meta['spec'])}' (hash {meta['spec_hash']})"
                what = "; what differs:\n" + "\n".join(list(diff)[:40])
            else:
                saved, what = f"hash {meta['spec_hash']}", ""
            raise ValueError(
                f"optimizer state was saved under spec {saved}, this optimizer runs '{self.spec.name}' "
                f"(hash {self.spec_hash}){what}\npass allow_spec_change=True to carry the state over by "
                f"parameter name")
        if (meta.get("sharded") or self._sharded) and meta.get("world_size", self._executor.world) \
                != self._executor.world:
            raise ValueError(
                f"this optimizer state was saved {'sharded over' if meta.get('sharded') else 'on'} "
                f"{meta['world_size']} rank(s) and this run has {self._executor.world}: sharded state (FSDP2) loads "
                f"only at the world size it was saved at. Save and load with torch.distributed.checkpoint "
                f"(get_state_dict / set_state_dict), which reshards")
        if meta["spec_hash"] != self.spec_hash and all("param_names" in g for g in state_dict["param_groups"]):
            return self._migrate(state_dict, source, meta, model)
        try:
            super().load_state_dict(state_dict)
        except ValueError as err:  # a checkpoint without names whose groups do not line up
            raise ValueError(f"{err}: this checkpoint has no parameter names, so its state can only be loaded "
                             f"into the same rules in the same order") from None
        # torch.optim casts floating state to the parameter's dtype (it calls
        # Optimizer._process_value_according_to_param_policy directly, so an override is never
        # used); geomopt keeps float32 state for bf16 parameters: reload it with the device only.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is not None:
                self.state[p] = {k: _to_device(v, p.device) for k, v in saved.items()}
        for group in self.param_groups:
            group["spec_hash"] = self.spec_hash
        if self.spec_hash != meta["spec_hash"]:
            old = meta.get("spec_groups") or [{}] * len(self.param_groups)
            for group, was, now in zip(self.param_groups, old, self._spec_groups):
                self._follow_spec(group, was, now)
        if len(meta.get("counters", [])) == len(self._counters):
            self._counters = [_copy_counters(c) for c in meta["counters"]]
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)
        return None

    def _follow_spec(self, group: dict, was: dict, now: dict) -> None:
        """After a spec change: the group values the new spec sets differently follow it."""
        for key in self._SPEC_KEYS:
            if key not in was or was[key] != now[key]:
                group[key] = _copy(now[key])

    def _migrate(self, state_dict: dict, source: str, meta: Optional[dict], model) -> MigrationReport:
        """Carry a state over by parameter name (:mod:`geomopt.optim.migrate`); everything is
        built first and installed at the end, so a failure leaves the optimizer as it was."""
        if model is not None:
            named = list(model.named_parameters())
            order = ([n for n, _ in named], [n for n, q in named if q.requires_grad])
        else:
            order = self._order
        names = saved_names(state_dict, *order)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = {name: translate(state_dict["state"][i], source) for name, i in zip(names, ids)
                 if i in state_dict["state"]}
        groups = [dict(g) for g in self.param_groups]
        counters = list(self._counters)
        if meta is not None:  # a geomopt checkpoint: groups and counters follow their rule's name
            by_rule = {g.get("rule"): i for i, g in enumerate(state_dict["param_groups"])}
            spec_groups = meta.get("spec_groups") or [{}] * len(state_dict["param_groups"])
            for k, (group, now) in enumerate(zip(groups, self._spec_groups)):
                i = by_rule.get(group["rule"])
                if i is None:
                    continue
                kept = {key: _copy(v) for key, v in state_dict["param_groups"][i].items()
                        if key not in ("params", "param_names", "spec_hash")}
                groups[k] = dict(group, **kept)
                self._follow_spec(groups[k], spec_groups[i], now)
                if len(meta.get("counters", [])) == len(state_dict["param_groups"]):
                    counters[k] = _copy_counters(meta["counters"][i])
        targets = [(pp.name, p, pp, group["direction"])
                   for group, plans in zip(groups, self._plans) for p, pp in zip(group["params"], plans)]
        transposed = set(meta["transposed"]) if meta is not None and "transposed" in meta else None
        state, report = migrate_state(saved, targets, source, transposed)
        # install (nothing above wrote to the optimizer)
        self.state = defaultdict(dict, state)
        for group, new in zip(self.param_groups, groups):
            group.clear()
            group.update(new)
        self._counters = counters
        self._buffers.clear()
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
        log.info("%s", report)
        return report


def _copy_counters(c: dict) -> dict:
    return dict(c, fallbacks=c["fallbacks"].clone(), update_sq=c["update_sq"].clone())


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _new_counters() -> dict:
    return dict(skipped=0, fallbacks=torch.zeros((), dtype=torch.int64), update_sq=torch.zeros(()))


def _spec_name(yaml_text: str) -> str:
    for line in yaml_text.splitlines():
        if line.startswith("name:"):
            return line.split(":", 1)[1].strip()
    return "?"


# per-parameter state tensors that batched calls keep stacked (entries are views of a bucket buffer)
_STACKED = ("d", "exp_avg", "exp_avg_sq", "prev", "w", *post_stages.STAGE_STATE)
_FUSED_ADAM_DEVICES = ("cpu", "cuda")  # where torch._fused_adamw_ has kernels


#: entries of a block of the flat path (:func:`_blocks`): 4 MiB per float32 array, so a block's
#: parameters, gradients, state and scratch stay in cache (a 32 MiB L3) between its ops. Sign
#: descent on an HF GPT-2 (6.7M and 40M parameters, 2-core AVX2 CPU): 2^20 was 11–18% faster than
#: one pass of each op over everything; 2^16 and 2^18 lost that to per-block overhead, 2^22 to cache
BLOCK = 1 << 20


def _blocks(xs: list, cap: int, rows: bool = True) -> list:
    """The flat path's blocks over ``xs`` (in flat order): ``(pieces, offset, numel)`` with
    ``pieces`` a list of (tensor index, first row, end row) (rows None: the whole tensor) of at
    most ``cap`` entries (a row larger than that is a block of its own); ``rows=False`` keeps
    tensors whole (a tensor larger than ``cap`` is then a block of its own)."""
    out, pieces, off, n = [], [], 0, 0

    def close():
        nonlocal pieces, off, n
        if pieces:
            out.append((pieces, off, n))
            pieces, off, n = [], off + n, 0

    for i, x in enumerate(xs):
        size = x.numel()
        if n + size <= cap or not rows or x.dim() == 0:
            if n + size > cap:
                close()
            pieces.append((i, None, None))
            n += size
            continue
        row, start = size // x.shape[0], 0
        while start < x.shape[0]:
            k = (cap - n) // row
            if k == 0 and n:
                close()
                continue
            end = min(x.shape[0], start + max(k, 1))
            pieces.append((i, start, end))
            n += (end - start) * row
            start = end
            if n >= cap:
                close()
    close()
    return out


def _cut(ts: list, pieces: list) -> list:
    """The ``pieces`` (:func:`_blocks`) of the tensors ``ts``."""
    return [ts[i] if a is None else ts[i][a:b] for i, a, b in pieces]


def _fused_adam(xs: list, us: list) -> bool:
    """Whether torch's fused AdamW kernel can step ``xs`` with directions ``us``: a device that
    has one, and every tensor contiguous (the kernel walks all of them in memory order, so a
    channels_last or transposed parameter or gradient takes the unfused ops)."""
    return xs[0].device.type in _FUSED_ADAM_DEVICES and all(t.is_contiguous() for t in (*xs, *us))


def _flat_like(xs: list) -> tuple:
    """An empty flat buffer holding every tensor of ``xs``, and its views shaped like them."""
    buf = torch.empty(sum(x.numel() for x in xs), dtype=xs[0].dtype, device=xs[0].device)
    return buf, _split_like(buf, xs)


def _split_like(flat: torch.Tensor, xs: list) -> list:
    return [v.view(x.shape) for v, x in zip(flat.split([x.numel() for x in xs]), xs)]


def _sum_finite(t) -> torch.Tensor:
    """False when some entry is NaN or ±∞ (also, rarely, when the sum overflows): one read."""
    if isinstance(t, list):
        # CUDA: one multi-tensor launch; its squares overflow from |entries| ≈ 1.8e19, and such a
        # step then takes the entry-by-entry test (_skip_nonfinite). CPU: sums (about 2× faster
        # than norms there, measured)
        parts = torch._foreach_norm(t) if t[0].is_cuda else [x.sum() for x in t]
        return torch.isfinite(torch.stack(parts).sum())
    return torch.isfinite(t.sum())


def _finite(t) -> torch.Tensor:
    """All entries finite (max |·| is NaN or ∞ exactly when some entry is)."""
    if isinstance(t, list):
        return torch.stack([_finite(x) for x in t]).all()
    # abs().amax() propagates NaN and ∞ and is an order of magnitude faster on CPU than
    # isfinite().all() or vector_norm(ord=inf)
    return torch.isfinite(t.abs().amax()) if t.numel() else torch.ones((), dtype=torch.bool)


def _in_set(x: torch.Tensor, xp: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether x is in the set that ``xp`` = P_C(x) projects onto, up to rounding: ‖xp − x‖_F ≤
    (64u + 2u_dtype)·‖x‖_F, u the working precision (what re-projecting a point of the set moves it
    by: an SVD or eigh reconstruction) and u_dtype the parameter's (a point of the set rounded to
    bf16)."""
    slack = 64 * torch.finfo(x.dtype).eps + 2 * torch.finfo(dtype).eps
    return bool(torch.linalg.vector_norm(xp - x) <= slack * torch.linalg.vector_norm(x))


def _stack(tensors: list) -> torch.Tensor:
    """Stack along a new leading dim; one tensor becomes a view (no copy)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (bf16 gradients and state in float32; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _view(t: torch.Tensor, pp: ParamPlan) -> torch.Tensor:
    """The tensor as the operators see it (transposed for ``layout: in_out``)."""
    return t.transpose(0, 1) if pp.transpose else t




def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor is all-gathered: every rank must call this)."""
    return t.full_tensor() if is_dtensor(t) else t


def _my_shard(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of ``full`` for a DTensor sharded like ``like``."""
    dim = like.placements[0].dim % like.ndim
    mesh = like.device_mesh
    return full.split(chunk_sizes(full.shape[dim], mesh.size()), dim=dim)[mesh.get_local_rank()]


def _state_row(entry: torch.Tensor, pp: ParamPlan, key: str) -> torch.Tensor:
    """A state entry as a row of its bucket's stacked state (local data, operators' layout)."""
    if not is_dtensor(entry):
        return entry
    local = entry.to_local()
    return _view(local, pp) if key in VIEW_KEYS else local


def _op_shard_dim(p, pp: ParamPlan) -> int:
    """The dim of the operators' view of DTensor ``p`` that is cut across ranks."""
    dim = p.placements[0].dim % p.ndim
    return 1 - dim if pp.transpose and dim < 2 else dim


def _state_entry(row: torch.Tensor, p: torch.Tensor, pp: ParamPlan, key: str, whole: bool = False) -> torch.Tensor:
    """Inverse of :func:`_state_row`: for a sharded parameter, a DTensor sharded like it. A stage's
    state (:data:`geomopt.optim.stages.STAGE_STATE`) has its own shape in the operators' layout: a
    DTensor cut along the same dim as the tensor, or replicated (``whole``) where it is a statistic
    over that dim, which every rank holds whole."""
    if not is_dtensor(p):
        return row
    from torch.distributed.tensor import DTensor
    if key in post_stages.STAGE_STATE:
        from torch.distributed.tensor import Replicate, Shard

        if whole:
            return DTensor.from_local(row, p.device_mesh, (Replicate(),), run_check=False)
        dim = _op_shard_dim(p, pp)
        shape = list(row.shape)
        shape[dim] = pp.op_shape[dim]
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * max(shape[i + 1], 1)
        return DTensor.from_local(row, p.device_mesh, (Shard(dim),), run_check=False, shape=torch.Size(shape),
                                  stride=tuple(stride))

    local = _view(row, pp) if key in VIEW_KEYS else row
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _decayed(x: torch.Tensor, step: torch.Tensor, decay: float, cautious: bool) -> torch.Tensor:
    """X(1 − γλ) (decoupled), or, cautious (Chen et al. 2025), X(1 − γλ) only where the step S and
    X agree in sign (S⊙X ≥ 0) and X elsewhere."""
    if not cautious:
        return x * decay
    return torch.where(step * x >= 0, x * decay, x)


def _warmed(alpha, group: dict, direction: dict):
    """α of this step under a Polyak momentum warmup: from ``warmup_alpha`` at step 0 linearly to
    the group's α at ``warmup_steps``, then the group's (a schedule's own α wins)."""
    steps = direction.get("warmup_steps", 0)
    if alpha is not None or not steps:
        return alpha
    frac = min(group["step"] / steps, 1.0)
    start = direction["warmup_alpha"]
    return start + (group["alpha"] - start) * frac
