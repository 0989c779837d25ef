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

import copy
from typing import Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer

from geomopt.compile.compiler import as_spec, needs_roles, plan_from_infos
from geomopt.compile.lock import check_routing, model_label
from geomopt.compile.plan import Plan
from geomopt.distributed.executors import LocalExecutor, ShardedExecutor, make_executor
from geomopt.distributed.layout import layout_key
from geomopt.optim import checkpoint
from geomopt.optim.atomic import PendingStep, drive, interrupted
from geomopt.optim.bucket_step import BucketJob, radius_factor
from geomopt.geometry.capture import capturing
from geomopt.optim.capturable import captured_step, counts_on_device
from geomopt.optim.checkpoint import new_counters, spec_hash, spec_values
from geomopt.optim.migrate import MigrationReport
from geomopt.optim.contract import (check_complex, collect_params, copy_state, pickled_state,
                                    check_gradient, dense, tensor_lr, with_overrides)
from geomopt.optim.construction import (check_capturable, check_dion, project_on_init, warn_guessed_roles,
                                        warn_slow_bf16, warn_unused_rules)
from geomopt.optim.diagnostics import diagnostics
from geomopt.optim.directions import previous_gradients
from geomopt.optim.flat import step_flat
from geomopt.optim.nonfinite import launch_check, skip_nonfinite
from geomopt.optim.qkclip import QKClip
from geomopt.optim.program import IMPLEMENTATIONS, Options, Program, dispatch, flat_rule, signature
from geomopt.optim.runtime import Runtime
from geomopt.optim.schedules import SCHEDULES, warmup_alpha
from geomopt.optim.stacked import COUNTS, STACKED
from geomopt.optim.tensors import as_real, local, op_layout, op_view, stack
from geomopt.spec.model import RESOLVED_DEFAULTS, Spec

__all__ = ["GeomOptimizer"]


class GeomOptimizer(Optimizer):
    """``GeomOptimizer(model_or_named_parameters, spec)``: spec is a Spec, a path or a dict.

    ``model_or_named_parameters`` may also be ``model.parameters()`` or param-group dicts (no
    per-group options: groups are the spec's rules), named by ``model=`` (by identity, roles from
    the model) or else ``param.<i>`` in order with roles guessed from shapes and a
    :class:`~geomopt.optim.contract.GeneratedNamesWarning` (:func:`~geomopt.optim.contract.collect_params`).

    ``lr``, ``weight_decay``: replace the spec's ``defaults:`` values; a rule that sets its own
    keeps it (:mod:`geomopt.optim.contract`). Checked: finite, lr > 0, weight_decay ≥ 0. ``lr`` may
    be a 1-element tensor, as in torch.optim: the groups that take the default lr hold it (a 0-d
    view; a capturable step reads it on its device, the others read its value once per step), and
    the spec records its value.

    ``roles``: role → name patterns (``{"head": ["proj_out.weight"]}``), over the roles inferred
    from the model (:mod:`geomopt.compile.roles`) and the spec's ``roles:``. Roles are decided by
    what each tensor does in one traced forward of an ``nn.Module`` (:mod:`geomopt.compile.trace`:
    on the meta device, else one tiny forward that leaves the model as it was), from its
    module tree where no trace runs, guessed from names and shapes for an iterable of
    (name, tensor), and only where the spec reads them (``match: {role: …}``, ``view: auto``).
    ``example_inputs``: the traced forward's inputs (a tensor, a tuple of positional arguments, a
    dict of keyword arguments, or a callable returning one); Hugging Face models and models with
    an ``example_inputs()`` method supply their own. Without inputs, or when the forward fails,
    roles come from the module tree, and the optimizer warns once saying why and how to fix it
    (:class:`~geomopt.lint.roles.RolesGuessedWarning`; ``geomopt lint`` notes it, GO124).

    ``track_update``: measure ‖X⁺ − X‖ each step for :meth:`diagnostics` (two passes over
    every tensor: off by default, like the gap).

    ``track_gap``: keep W = (X⁺ − Y)/(γρ) after each step so :meth:`diagnostics` can report the
    stationarity gap against the next gradient (one extra tensor per parameter).

    STORM directions need ``step(closure)``: the closure computes the loss on the current batch
    and calls ``backward()`` (zeroing gradients in it is harmless: the optimizer sets them to None
    before each evaluation); the optimizer evaluates it at the previous iterate and at the current
    one (same batch), except on the first step.

    Non-finite gradients (any group) skip the whole step or raise, per rule (``on_nonfinite``),
    before anything is written; rules with ``on_nonfinite: off`` are not tested (a NaN propagates,
    as in torch) and step even when the others skip (:mod:`geomopt.optim.nonfinite`).

    Zero-size tensors (a dim of size 0) are accepted under every rule and never step: no state,
    no projection, nothing in :meth:`diagnostics`, as a tensor without a gradient.

    ``distributed``: ``"auto"`` (default) runs sharded when the parameters are DTensors (FSDP2,
    HSDP, tensor and expert parallelism, on meshes of any dims), replicated (DDP) when
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

    ``capturable`` (off by default): a step makes no host synchronization, the first one (which
    creates the state) included, so it can be captured whole (a CUDA graph after a warm-up step,
    as torch's optimizers; ``torch.compile`` from the first call): the finiteness test's flag
    stays on the device and every write selects the new value where it is true and the old one
    elsewhere, so a skipped step leaves every bit as it was (as fused AdamW's ``found_inf``); step
    counts are device tensors, and every rule runs batched from stacked copies. One process; not
    with STORM, ``on_nonfinite: raise`` or a momentum warmup, which read the host (refused, saying so).

    ``expect``: a routing lock (a file ``geomopt plan … --lock`` wrote, or a
    :class:`geomopt.compile.lock.Lock`): raises :class:`geomopt.RoutingChangedError`, with the diff,
    when the plan routes a tensor to another rule, role or view than the lock, or the tensors
    differ, before anything is built (a run that would silently fall back to AdamW stops here).
    """

    def __init__(self, model_or_named_parameters, spec: Union[Spec, str, dict], *,
                 lr: Union[float, torch.Tensor, None] = None,
                 weight_decay: Optional[float] = None, model=None, track_gap: bool = False,
                 track_update: bool = False, distributed: Union[str, bool] = "auto", process_group=None,
                 cuda_graphs: bool = False, roles: Optional[dict] = None, implementation: str = "auto",
                 example_inputs=None, expect=None, capturable: bool = False):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, not {implementation!r}")
        self.implementation = implementation
        self.spec = with_overrides(as_spec(spec), lr, weight_decay)
        infos, tensors, source, generated = collect_params(model_or_named_parameters, model,
                                                           needs_roles(self.spec, roles), example_inputs)
        # names given as param.<i> (tensors passed without names): a load matches them by position
        self._generated_names = generated
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
        self.capturable = capturable
        groups, self._plans = [], []
        lr_tensor = tensor_lr(lr)  # a tensor lr=: the groups of the rules that take the default lr hold it
        for index, rule in enumerate(self.spec.rules):
            plans = [p for p in self.plan if p.rule_index == index]
            if not plans:
                continue
            first = plans[0]
            d = first.direction
            # every hyper-parameter a step reads lives here (one source of truth): the plan keeps
            # the operators and each tensor's radius factor
            coefficients = {k: v for k, v in d.items() if k in checkpoint.DIRECTION_KEYS}
            groups.append(dict(
                params=[tensors[p.name] for p in plans], param_names=[p.name for p in plans], rule=rule.name,
                spec_hash=self.spec_hash, lr=first.lr if lr_tensor is None or rule.lr is not None else lr_tensor,
                weight_decay=first.weight_decay, radius=first.geometry["radius"], direction=d["kind"],
                alpha=d.get("alpha", 1.0), nesterov=d.get("nesterov", False), init=d.get("init", "zero"),
                **coefficients, schedule=first.schedule, on_nonfinite=first.on_nonfinite, step=0,
            ))
            self._plans.append(plans)
        self._building = True
        super().__init__(groups, dict(lr=RESOLVED_DEFAULTS["lr"], weight_decay=RESOLVED_DEFAULTS["weight_decay"]))
        self._building = False
        # what the spec set per group, saved with the state: after a spec change, values the new
        # spec changed win over the checkpoint's (load_state_dict)
        self._spec_groups = [spec_values(g) for g in self.param_groups]
        self._counters = [new_counters() for _ in self.param_groups]
        # same-(ops, shape, dtype, device) tensors of a group, and sharded ones of one mesh and
        # placements, are a bucket (zero-size tensors are in none: they never step)
        self._buckets = []
        for group, plans in zip(self.param_groups, self._plans):
            by_key: dict = {}
            for i, p in enumerate(group["params"]):
                if p.numel():
                    by_key.setdefault((plans[i].bucket, layout_key(p)), []).append(i)
            self._buckets.append(list(by_key.values()))
        # geomopt.distributed: LocalExecutor, ReplicatedExecutor or ShardedExecutor
        self._executor: Any = make_executor([p for g in self.param_groups for p in g["params"]], distributed,
                                            process_group, names=[pp.name for plans in self._plans for pp in plans])
        self._options = Options(
            local=isinstance(self._executor, LocalExecutor), sharded=isinstance(self._executor, ShardedExecutor),
            keeps_prev=any(g["direction"] == "storm" for g in self.param_groups), track_gap=track_gap,
            track_update=track_update, cuda_graphs=cuda_graphs, implementation=implementation, capturable=capturable)
        check_capturable(self.param_groups, self._plans, self._options)
        check_dion(self.param_groups, self._options)
        self._rt = self._runtime()
        check_complex(self.param_groups, self._plans, lambda g, pp: flat_rule(g, pp, self._options) is None)
        self._programs: list[list[Program]] = []
        self._dispatch()
        warn_slow_bf16(self.spec, self.plan, tensors)
        warn_unused_rules(self.spec, infos)
        warn_guessed_roles(infos)
        self._qk_clip = QKClip(self.param_groups, self._plans, source, self.spec)  # geomopt.optim.qkclip: checks
        project_on_init(self.param_groups, self._plans, self._executor)

    def _runtime(self) -> Runtime:
        """The step's runtime (:mod:`geomopt.optim.runtime`), with the sharded parameters' layouts
        as the operators see them (transposed for layout: in_out)."""
        rt = Runtime(self._executor, graph_cap=2 * sum(map(len, self._buckets)))
        # entries of the largest bucket (what a batched step stacks at once): bounds the flat path's blocks
        rt.largest_bucket = max((sum(g["params"][i].numel() for i in b)
                                 for g, bs in zip(self.param_groups, self._buckets) for b in bs), default=1)
        blocks = getattr(self._executor, "layouts", {})
        rt.stacked.layouts = {id(p): op_layout(blocks[id(p)], pp) for g, plans in zip(self.param_groups, self._plans)
                              for p, pp in zip(g["params"], plans) if id(p) in blocks}
        return rt

    def _dispatch(self) -> None:
        """Build every bucket's step program (:func:`geomopt.optim.program.dispatch`), and note the
        group values they were built from: a step builds them again when those change."""
        self._programs = dispatch(self.param_groups, self._plans, self._buckets, self._options)
        self._built_from = [signature(g) for g in self.param_groups]
        progs = [p for ps in self._programs for p in ps]  # not deferred where a rule is off
        self._deferred = (self._options.local and not self._options.keeps_prev and all(p.check != "off" for p in progs)
                          and all(p.check == "deferred" for p in progs if p.variant == "batched"))

    def describe(self) -> str:
        """Every bucket's step program (:mod:`geomopt.optim.program`): its tensors, stages,
        variant and why each choice was made, as text (``geomopt plan … --program`` prints it)."""
        if [signature(g) for g in self.param_groups] != self._built_from:
            self._dispatch()
        off = all(p.check == "off" for progs in self._programs for p in progs)
        test = "off" if off else "deferred behind the forward ops" if self._deferred else "before any write"
        head = (f"spec '{self.spec.name}': {sum(map(len, self._programs))} step program(s); finiteness test "
                f"{test}; executor {type(self._executor).__name__}")
        return "\n".join([head] + [p.describe() for progs in self._programs for p in progs])

    # ------------------------------------------------------------ set-up

    def add_param_group(self, param_group: dict) -> None:
        """Groups come from the spec's rules (one per rule): a group added later would have no
        plan and never step, so it is refused."""
        if not getattr(self, "_building", False):
            raise RuntimeError("GeomOptimizer's param groups are the spec's rules: add a rule to the spec (and "
                               "build a new optimizer) instead of calling add_param_group")
        super().add_param_group(param_group)

    @property
    def work(self):
        """This rank's matrix-function work so far (:class:`~geomopt.distributed.WorkCounter`:
        matrices, FLOPs up to a constant, seconds): under DDP / FSDP2 about 1/world of the total."""
        return self._executor.work

    # ------------------------------------------------------------ checkpoints, copies, diagnostics

    def state_dict(self) -> dict:
        """torch's state dict and what the spec set (``"geomopt"``): :func:`geomopt.optim.checkpoint.state_dict`."""
        return checkpoint.state_dict(self)

    # override: torch's returns None; this one also takes allow_spec_change / model and returns the
    # MigrationReport of a state carried over from another spec or optimizer
    def load_state_dict(self, state_dict: dict, *, allow_spec_change: bool = False,  # type: ignore[override]
                        model=None) -> Optional[MigrationReport]:
        """Load a checkpoint, refusing one saved under a different spec unless
        ``allow_spec_change=True``: :func:`geomopt.optim.checkpoint.load_state_dict`."""
        return checkpoint.load_state_dict(self, state_dict, allow_spec_change=allow_spec_change, model=model)

    def diagnostics(self, *, gap_reference: str = "auto") -> dict[str, dict]:
        """Per rule: gap, dual norm, violation, update norm, skipped steps and fallbacks
        (:func:`geomopt.optim.diagnostics.diagnostics`)."""
        return diagnostics(self, gap_reference=gap_reference)

    def __getstate__(self) -> dict:
        """What pickle writes (:func:`geomopt.optim.contract.pickled_state`)."""
        return pickled_state(self)

    def __deepcopy__(self, memo: dict):
        """A deep copy keeps views as views (deepcopy copies each storage once)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(copy_state(self), memo))
        return new

    def __setstate__(self, state: dict) -> None:
        """Also how ``load_state_dict`` installs ``state`` and ``param_groups`` into this
        optimizer: what :data:`~geomopt.optim.contract.REBUILT` lists is made only where it is
        missing (a copy), never replaced (a sharded optimizer's layouts live in the runtime)."""
        super().__setstate__(state)  # torch's: hooks (empty where missing), the profiled step
        if "_rt" not in self.__dict__:
            self._rt = self._runtime()

    # ------------------------------------------------------------ the step

    # override: torch's stub types the closure's loss as a float; geomopt returns what the closure
    # returns (a Tensor, as torch's own optimizers do at run time)
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):  # type: ignore[override]
        """One step for every parameter that has a gradient; returns the closure's loss.

        Each job (a bucket's tensors with gradients, or an elementwise rule's pooled tensors) runs
        its step program (:meth:`describe`). Non-finite gradients are checked in every group
        before anything is written: under ``on_nonfinite: raise`` (of a rule that has one) the
        step raises, otherwise the whole step is skipped and counted in the rules that had them;
        either way parameters and all optimizer state are left exactly as they were. A sparse
        gradient raises (RuntimeError, naming the tensor), also before anything is written."""
        self._qk_clip.check()  # QK-clip: a monitor is attached, before anything is written
        loss = None
        g_prev: dict = {}
        if self._options.keeps_prev:
            if closure is None:
                raise RuntimeError(
                    "this spec uses a storm direction, which evaluates the gradient at the previous and the "
                    "current iterate on the same batch: call opt.step(closure) with a closure that zeroes the "
                    "gradients, computes the loss and calls backward()")
            g_prev = previous_gradients(self, closure)
            self.zero_grad(set_to_none=True)  # a closure that forgets zero_grad must not add g(x_{k-1})
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            if [signature(g) for g in self.param_groups] != self._built_from:
                self._dispatch()  # a group's direction changed: its programs follow
            rt, groups = self._rt, self.param_groups
            jobs = self._jobs()
            grads = [self._job_grads(prog, items) for prog, items in jobs]
            prevs = [stack([op_view(local(g_prev[p]), pp) for p, pp in items])
                     if all(g_prev.get(p) is not None for p, _ in items) else None for _, items in jobs]
            if self._options.capturable and jobs:
                done: list = []  # no host sync, the first step (creating the state) included
                counts_on_device(groups, self.state, self._counters, jobs)  # a no-op once they are
                try:
                    captured_step(rt, groups, self.state, self._counters, jobs, grads, done)
                except BaseException as err:  # inside a CUDA-graph capture nothing ran: nothing is pending
                    if not capturing():
                        self._pending = interrupted(self._pending, err, jobs, done, groups, self._plans, True)
                    raise
                self._pending = None
                return loss
            check = launch_check(rt, jobs, grads, prevs)  # None: no job is tested (on_nonfinite: off)
            # deferred: the buckets launch their forward ops (reads into scratch) before the host
            # waits for the test, so the device stays busy; nothing is written before the wait
            defer = self._deferred
            if not defer:  # a skipped step still steps the jobs of on_nonfinite: off rules
                keep = skip_nonfinite(rt, groups, self._counters, jobs, check)
                if len(keep) < len(jobs):
                    if not keep or self._pending is not None:  # an interrupted step's retry: all or nothing
                        return loss
                    jobs, grads, prevs = ([xs[k] for k in keep] for xs in (jobs, grads, prevs))
            schedules, devices = {}, {}
            for prog, items in jobs:
                gi = prog.group
                if gi not in schedules:
                    gamma, alpha = SCHEDULES[groups[gi]["schedule"]["kind"]](groups[gi], groups[gi]["step"])
                    # a tensor lr is read once here (this step syncs anyway); a capturable step keeps it
                    schedules[gi] = (float(gamma), warmup_alpha(alpha, groups[gi]))
                    devices[gi] = items[0][0].device

            pending = self._pending
            done = []  # indices of the jobs whose writes are complete (committed)

            def writes() -> bool:
                """Everything that writes at once; False when the step is skipped."""
                if defer and len(skip_nonfinite(rt, groups, self._counters, jobs, check)) < len(jobs):
                    return False  # deferred: every rule tested alike (dispatch), so the whole step
                if pending is None:  # a completed retry counts the whole step's update
                    for gi, device in devices.items():
                        self._counters[gi]["update_sq"] = torch.zeros((), device=device)
                for j, ((prog, items), g) in enumerate(zip(jobs, grads)):
                    if prog.variant == "flat":
                        step_flat(prog, rt, self.state, groups[prog.group], items, g, *schedules[prog.group])
                        done.append(j)
                return True

            try:
                if not defer:
                    writes()
                shared = not defer and self._options.local  # buckets one after another
                steps = [(j, BucketJob(prog, rt, self.state, self._counters[prog.group], groups[prog.group], items,
                                       g, gp, *schedules[prog.group], shared=shared))
                         for j, ((prog, items), g, gp) in enumerate(zip(jobs, grads, prevs)) if prog.variant != "flat"]
                if not drive(self._executor.run, steps, done.append, writes if defer else None,
                             lockstep=not self._options.local):
                    return loss
            except BaseException as err:
                self._pending = interrupted(self._pending, err, jobs, done, groups, self._plans, self._options.local)
                raise
            for gi in set(schedules) | (pending.groups if pending is not None else set()):
                groups[gi]["step"] += 1
            self._pending = None
            if not self._options.capturable:  # a captured (or compiled) step reuses the scratch it took
                rt.workspace.release()  # nothing of the step's scratch is held between steps
            self._qk_clip.apply()  # QK-clip after the step (geomopt.optim.qkclip)
        return loss

    @property
    def pending_step(self) -> Optional[dict]:
        """After a step that raised part-way: ``{"done": [names of the tensors whose update is
        written], "groups": [indices]}``; the next ``step()`` applies only the others. None
        otherwise."""
        return None if self._pending is None else self._pending.to_dict()

    def _jobs(self) -> list:
        """(program, [(param, plan), …]) per call: a bucket's tensors that have a gradient (a
        zero-size tensor is in no bucket: it never steps nor gets state), split by state history
        (a tensor that missed steps has its own step counts). An elementwise rule's ``flat``
        buckets pool their tensors of one dtype, device and radius, whatever their shapes, into
        one flat call (:func:`geomopt.optim.flat.step_flat`)."""
        jobs: list = []
        for group, plans, progs in zip(self.param_groups, self._plans, self._programs):
            for prog in progs:
                flat = prog.variant == "flat"
                by_key: dict = {}
                for i in prog.indices:
                    p = group["params"][i]
                    if p.grad is None or (self._pending is not None and id(p) in self._pending.done):
                        continue  # no gradient, or committed by an interrupted step this one completes
                    check_gradient(group, plans[i], p, p.grad)
                    st = self.state[p]
                    # the step counts by value (the host's, read off the CPU); a capturable step's
                    # device counts by identity (a bucket's tensors share one), with no host read
                    counts = tuple(st.get(k) if self._options.capturable or k not in st else int(st[k])
                                   for k in COUNTS)
                    key: tuple = (tuple(sorted(k for k in st if k in STACKED)), counts)
                    if flat:
                        key += (radius_factor(plans[i]),)
                    by_key.setdefault(key, (prog, []))[1].append((p, plans[i]))
                jobs.extend(by_key.values())
        return jobs

    @staticmethod
    def _job_grads(prog: Program, items: list):
        """A job's gradients: stacked (batched ops), or a list (views, no copy) where the flat
        variant or a Polyak direction reads them tensor by tensor (the program's direction form)."""
        grads = [as_real(op_view(local(dense(p.grad)), pp)) for p, pp in items]
        if prog.variant == "flat" or prog.direction_form in ("rows", "ahead"):
            return grads
        return stack(grads)
