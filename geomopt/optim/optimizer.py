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

import warnings
from typing import Callable, Optional, Union

import torch
from torch.optim import Optimizer

from geomopt.compile.compiler import as_spec, needs_roles, plan_from_infos
from geomopt.compile.lock import check_routing, model_label
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.distributed.executors import LocalExecutor, ShardedExecutor, is_dtensor, make_executor
from geomopt.distributed.layout import layout_key
from geomopt.geometry.prox import backward
from geomopt.geometry.dtypes import BF16Warning, slow_bf16
from geomopt.geometry.polynomial import muon_order
from geomopt.optim.atomic import PendingStep, drive, interrupted
from geomopt.optim.bucket_step import BucketStep
from geomopt.optim.checkpoint import Checkpoints, copy_value, new_counters, spec_hash
from geomopt.optim.contract import Copyable, check_complex, collect_params, sparse_gradient, with_overrides
from geomopt.optim.diagnostics import Diagnostics, euclidean_geometry
from geomopt.optim.flat import IMPLEMENTATIONS, FlatPath
from geomopt.optim.nonfinite import NonFiniteCheck
from geomopt.optim.qkclip import QKClip
from geomopt.optim.schedules import SCHEDULES, warmup_alpha
from geomopt.optim.stacked import STACKED, StackedState
from geomopt.optim import stages as post_stages
from geomopt.optim.tensors import FLAT_DTYPES, as_real, full, in_set, local, op_layout, op_view, stack, upcast
from geomopt.optim.workspace import Workspace
from geomopt.spec.model import RESOLVED_DEFAULTS, Spec
from geomopt.lint.runner import lint_spec
from geomopt.lint.coverage import UnusedRuleWarning
from geomopt.spec.validate import source_of

__all__ = ["GeomOptimizer"]


class GeomOptimizer(Copyable, Checkpoints, Diagnostics, NonFiniteCheck, FlatPath, BucketStep, Optimizer):
    """``GeomOptimizer(model_or_named_parameters, spec)``: spec is a Spec, a path or a dict.

    ``model_or_named_parameters`` may also be ``model.parameters()`` or param-group dicts (no
    per-group options: groups are the spec's rules), named by ``model=`` (by identity, roles from
    the model) or else ``param.<i>`` in order with roles guessed from shapes and a
    :class:`~geomopt.optim.contract.GeneratedNamesWarning` (:func:`~geomopt.optim.contract.collect_params`).

    ``lr``, ``weight_decay``: replace the spec's ``defaults:`` values; a rule that sets its own
    keeps it (:mod:`geomopt.optim.contract`). Checked: finite, lr > 0, weight_decay ≥ 0.

    ``roles``: role → name patterns (``{"head": ["proj_out.weight"]}``), over the roles inferred
    from the model (:mod:`geomopt.compile.roles`) and the spec's ``roles:``. Roles are decided by
    what each tensor does in one traced forward of an ``nn.Module`` (:mod:`geomopt.compile.trace`:
    on the meta device, else one tiny forward that leaves the model as it was), from its
    module tree where no trace runs, guessed from names and shapes for an iterable of
    (name, tensor), and only where the spec reads them (``match: {role: …}``, ``view: auto``).
    ``example_inputs``: the traced forward's inputs (a tensor, a tuple of positional arguments, a
    dict of keyword arguments, or a callable returning one); Hugging Face models and models with
    an ``example_inputs()`` method supply their own. Without inputs, or when the forward fails,
    roles come from the module tree and ``geomopt lint`` says why (GO124).

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

    Zero-size tensors (a dim of size 0) are accepted under every rule and never step: no state,
    no projection, nothing in :meth:`diagnostics`, as a tensor without a gradient.

    ``distributed``: ``"auto"`` (default) runs sharded when the parameters are DTensors (FSDP2 on
    a 1-D mesh; HSDP or FSDP2 × tensor parallel on a 2-D one), replicated (DDP) when
    ``torch.distributed`` is initialized with more than one rank, and local otherwise; ``"ddp"`` /
    ``"fsdp"`` insist on one mode, ``False`` opts out. Under DDP each rank computes a balanced
    share of the matrix functions (Newton–Schulz, SVD, polar) and the results are all-gathered;
    sharded, elementwise work stays on each rank's block, norms are reduced over the mesh and each
    matrix function runs on one owning rank (:mod:`geomopt.distributed`).
    ``process_group``: the DDP group, or the group a sharded step communicates over (default: the
    parameters' mesh, or the world when they live on several sub-meshes).

    ``implementation``: how the elementwise (flat) path runs Adam: ``"auto"`` (default) through
    torch's fused AdamW kernel where the device has one (CPU, CUDA) and every tensor is
    contiguous, else foreach ops; ``"foreach"`` always the foreach ops (AdamW's single-tensor
    op order, bit for bit); ``"fused"`` as auto (the kernel where it exists).

    ``cuda_graphs`` (off by default): on CUDA in one process, replay each bucket's Newton–Schulz /
    Polar Express iteration from a CUDA graph captured on its first step (one launch instead of
    ~25; same kernels, same bits). It cuts the host's time per step (GPT-2-small's hidden
    matrices on an H100: 6.7 → 2.0 ms), which pays where the host is the bottleneck (small
    matrices, a slow CPU); each graph keeps a private memory pool of about its bucket's size in
    fp32 (+450 MiB there, for 340 MB of matrices). No effect on CPU, under torch.distributed, or
    while the caller is itself capturing a graph.

    ``expect``: a routing lock (a file ``geomopt plan … --lock`` wrote, or a
    :class:`geomopt.compile.lock.Lock`): raises :class:`geomopt.RoutingChangedError`, with the diff,
    when the plan routes a tensor to another rule, role or view than the lock, or the tensors
    differ, before anything is built (a run that would silently fall back to AdamW stops here).
    """

    def __init__(self, model_or_named_parameters, spec: Union[Spec, str, dict], *, lr: Optional[float] = None,
                 weight_decay: Optional[float] = None, model=None, track_gap: bool = False,
                 track_update: bool = False, distributed: Union[str, bool] = "auto", process_group=None,
                 cuda_graphs: bool = False, roles: Optional[dict] = None, implementation: str = "auto",
                 example_inputs=None, expect=None):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, not {implementation!r}")
        self.implementation = implementation
        self.spec = with_overrides(as_spec(spec), lr, weight_decay)
        infos, tensors, source = collect_params(model_or_named_parameters, model, needs_roles(self.spec, roles),
                                                example_inputs)
        self.plan: Plan = plan_from_infos(self.spec, infos, roles=roles)
        self.spec_hash = spec_hash(self.spec)
        if expect is not None:  # before anything is built or projected: a changed routing stops here
            check_routing(self.plan, expect, spec_hash=self.spec_hash, model=model_label(source))
        # the model's parameter order (a torch optimizer's state saved without names maps by it)
        self._order = ([i.name for i in infos], [i.name for i in infos if i.requires_grad])
        self._pending: Optional[PendingStep] = None  # an interrupted step (:mod:`geomopt.optim.atomic`)
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
        super().__init__(groups, dict(lr=RESOLVED_DEFAULTS["lr"], weight_decay=RESOLVED_DEFAULTS["weight_decay"]))
        self._building = False
        # what the spec set per group, saved with the state: after a spec change, values the new
        # spec changed win over the checkpoint's (load_state_dict)
        self._spec_groups = [{k: copy_value(g[k]) for k in self._SPEC_KEYS} for g in self.param_groups]
        self._counters = [new_counters() for _ in self.param_groups]
        # same-(ops, shape, dtype, device) tensors of a group run as one batched call (Plan buckets)
        # (zero-size tensors are in none: they never step, :meth:`_jobs`)
        self._buckets = []
        self._stepping = []  # per group, the indices of its tensors with entries (the flat path's order)
        for group, plans in zip(self.param_groups, self._plans):
            by_key: dict = {}
            stepping = [i for i, p in enumerate(group["params"]) if p.numel()]
            for i in stepping:  # sharded tensors stack their shards: same mesh and placements too
                by_key.setdefault((plans[i].bucket, layout_key(group["params"][i])), []).append(i)
            self._buckets.append(list(by_key.values()))
            self._stepping.append(stepping)
        self._stacked = StackedState()  # the buckets' stacked state; per-param state entries view its rows
        self._buffers = self._stacked.buffers
        self._workspace = Workspace()  # a step's scratch, shared by its buckets
        # entries of the largest bucket (what a batched step stacks at once): bounds the flat path's blocks
        self._largest_bucket = max((sum(g["params"][i].numel() for i in b)
                                    for g, bs in zip(self.param_groups, self._buckets) for b in bs), default=1)
        self._executor = make_executor([p for g in self.param_groups for p in g["params"]], distributed, process_group,
                                       names=[pp.name for plans in self._plans for pp in plans])
        self._sharded = isinstance(self._executor, ShardedExecutor)
        # sharded parameters' layouts as the operators see them (transposed for layout: in_out), once
        blocks = getattr(self._executor, "layouts", {})
        self._stacked.layouts = {id(p): op_layout(blocks[id(p)], pp) for g, plans in zip(self.param_groups, self._plans)
                                 for p, pp in zip(g["params"], plans) if id(p) in blocks}
        self._needs_closure = any(g["direction"] == "storm" for g in self.param_groups)
        check_complex(self.param_groups, self._plans, self._flat_rule)
        self._warn_slow_bf16(tensors)
        self._warn_unused_rules(infos)
        self._qk_clip = QKClip(self.param_groups, self._plans, source)  # QK-clip (geomopt.optim.qkclip): checks
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
                f"(a 512³ matmul ran at 1.2 against 119 GFLOP/s on an AVX2 CPU), so a step can take seconds. "
                f"Set the approx's "
                f"dtype to auto (bf16 on CUDA, float32 on CPU) or float32", BF16Warning, stacklevel=3)

    def _warn_unused_rules(self, infos: list) -> None:
        """One :class:`~geomopt.lint.coverage.UnusedRuleWarning` per rule that matches no tensor:
        lint's GO102 finding, so what lint calls idle (GO113, a role the model lacks) stays quiet
        and a ``# geomopt: disable=GO102`` comment on the rule silences it here too."""
        source = source_of(self.spec)
        for d in lint_spec(self.spec, infos, select="GO102"):
            if d.code != "GO102":
                continue  # GO123: a suppression comment of GO102 that silenced nothing
            where = f"{d.file}:{d.line}:{d.col}" if source is not None and source.values else f"spec '{self.spec.name}'"
            warnings.warn(
                f"{where}: GO102 {d.message} of this model, so it optimizes nothing (a misspelled pattern, or tensors "
                f"that are named otherwise): fix its match (`geomopt lint SPEC --model …` and `geomopt explain` show "
                f"the model's names) or delete the rule; to keep it, put `# geomopt: disable=GO102` on its line",
                UnusedRuleWarning, stacklevel=3)

    @torch.no_grad()
    def _project_on_init(self) -> None:
        """Project constrained tensors onto their set (geomopt.geometry.backward: feasibility), as Scion's init does,
        so every backward step is defined. A tensor already in the set (within rounding:
        :func:`in_set`) is left bit for bit as it is, so weights loaded before the optimizer is
        built resume exactly. A sharded tensor is projected whole (on every rank, once) and each
        rank keeps its shard."""
        for group, plans in zip(self.param_groups, self._plans):
            for p, pp in zip(group["params"], plans):
                c = pp.constraint
                if c is None or not pp.project_on_init or c["kind"] == "proximal_decay" or not p.numel():
                    continue
                x = op_view(full(p), pp)
                xu = upcast(x)
                xp, _ = backward(xu, 1.0, euclidean_geometry(pp), c)
                if in_set(xu, xp, x.dtype):
                    continue  # already feasible (a resumed run's weights): keep every bit
                x.copy_(xp)
                if is_dtensor(p):
                    block = self._executor.layouts[id(p)].slices(self._executor.rank)
                    p.to_local().copy_(op_view(x, pp)[block])  # _view is its own inverse

    @property
    def work(self):
        """This rank's matrix-function work so far (:class:`~geomopt.distributed.WorkCounter`:
        matrices, FLOPs up to a constant, seconds): under DDP / FSDP2 about 1/world of the total."""
        return self._executor.work

    def _scale(self, pp: ParamPlan) -> float:
        return pp.radius / pp.geometry["radius"]

    # ------------------------------------------------------------ the step

    # override: torch's stub types the closure's loss as a float; geomopt returns what the closure
    # returns (a Tensor, as torch's own optimizers do at run time)
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):  # type: ignore[override]
        """One step for every parameter that has a gradient; returns the closure's loss.

        Non-finite gradients are checked in every group before anything is written: under
        ``on_nonfinite: raise`` (of a rule that has one) the step raises, otherwise the whole step
        is skipped and counted in the rules that had them; either way parameters and all
        optimizer state are left exactly as they were. A sparse gradient raises (RuntimeError,
        naming the tensor), also before anything is written."""
        self._qk_clip.check()  # QK-clip: a monitor is attached, before anything is written
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
            prevs = [stack([op_view(local(g_prev[p]), pp) for p, pp in items])
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
                    schedules[gi] = (gamma, warmup_alpha(alpha, group, items[0][1].direction))
                    devices[gi] = items[0][0].device

            pending = self._pending
            done: list = []  # indices of the jobs whose writes are complete (committed)

            def writes() -> bool:
                """Everything that writes at once; False when the step is skipped."""
                if defer and self._skip_nonfinite(jobs, grads, prevs, check):
                    return False
                if pending is None:  # a completed retry counts the whole step's update
                    for gi, device in devices.items():
                        self._counters[gi]["update_sq"] = torch.zeros((), device=device)
                for j, ((gi, items, flat), g) in enumerate(zip(jobs, grads)):
                    if flat:
                        self._step_flat(self.param_groups[gi], items, g, *schedules[gi])
                        done.append(j)
                return True

            local_run = isinstance(self._executor, LocalExecutor)
            try:
                if not defer:
                    writes()
                shared = not defer and local_run  # buckets one after another
                steps = [(j, self._step_bucket(gi, self.param_groups[gi], items, g, gp, *schedules[gi],
                                               deferred=defer, shared=shared))
                         for j, ((gi, items, flat), g, gp) in enumerate(zip(jobs, grads, prevs)) if not flat]
                if not drive(self._executor.run, steps, done.append, writes if defer else None,
                             lockstep=not local_run):
                    return loss
            except BaseException as err:
                self._pending = interrupted(self._pending, err, jobs, done, self.param_groups, self._plans,
                                            isinstance(self._executor, LocalExecutor))
                raise
            for gi in set(schedules) | (pending.groups if pending is not None else set()):
                self.param_groups[gi]["step"] += 1
            self._pending = None
            self._qk_clip.apply()  # QK-clip after the step (geomopt.optim.qkclip)
        return loss

    @property
    def pending_step(self) -> Optional[dict]:
        """After a step that raised part-way: ``{"done": [names of the tensors whose update is
        written], "groups": [indices]}``; the next ``step()`` applies only the others. None
        otherwise."""
        return None if self._pending is None else self._pending.to_dict()

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
        gradient and entries (a zero-size tensor is left out, as one without a gradient: it never
        steps nor gets state), split by state history (a tensor that missed steps has its own step counts).
        ``flat``: an elementwise rule's tensors of one dtype and radius, whatever their shapes,
        run as one flat call (:meth:`_step_flat`)."""
        jobs = []
        for gi, (group, plans) in enumerate(zip(self.param_groups, self._plans)):
            flat = self._flat_rule(group, plans[0])
            buckets = [self._stepping[gi]] if flat else self._buckets[gi]  # zero-size tensors in neither
            for bucket in buckets:
                by_key: dict = {}
                for i in bucket:
                    p = group["params"][i]
                    if p.grad is None or (self._pending is not None and id(p) in self._pending.done):
                        continue  # no gradient, or committed by an interrupted step this one completes
                    if p.grad.layout != torch.strided:
                        raise sparse_gradient(plans[i].name, p.grad.layout)
                    st = self.state[p]
                    key: tuple = (tuple(sorted(k for k in st if k in STACKED)),
                           (st.get("adam_step"), st.get(post_stages.STAGE_STEP)))
                    if flat:
                        key += (p.dtype, p.grad.dtype, p.device, self._scale(plans[i]))
                        if not (p.dtype == p.grad.dtype and p.dtype in (torch.float32, torch.float64)):
                            key += (plans[i].bucket,)  # low precision: batched, per bucket
                    by_key.setdefault(key, []).append((p, plans[i]))
                for key, items in by_key.items():
                    ok = flat and key[2] == key[3] and key[2] in FLAT_DTYPES
                    jobs.append((gi, items, ok))
        return jobs

    def _job_grads(self, gi: int, items: list, flat: bool, g_prev: dict):
        """A job's gradients: stacked (batched ops), or a list (views, no copy) where the flat
        path or a Polyak direction reads them tensor by tensor (:meth:`_polyak_rows`)."""
        grads = [as_real(op_view(local(p.grad), pp)) for p, pp in items]
        group = self.param_groups[gi]
        if flat or (group["direction"] == "polyak" and not g_prev and grads[0].dtype in (torch.float32, torch.float64)
                    and all(g.dtype == grads[0].dtype for g in grads)):
            return grads
        return stack(grads)

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
