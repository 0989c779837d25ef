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
from collections import defaultdict
from collections.abc import Mapping
from typing import Callable, Optional, Union

import torch
from torch.optim import Optimizer

from geomopt.compile.compiler import as_spec, needs_roles, plan_from_infos
from geomopt.compile.lock import check_routing, model_label
from geomopt.compile.plan import Plan
from geomopt.optim.contract.diagnostics import diagnostics
from geomopt.optim.contract.torch_api import collect_params, copy_state, pickled_state, tensor_lr, with_overrides
from geomopt.optim.engine.construction import project_on_init, warn_guessed_roles, warn_slow_bf16, warn_unused_rules
from geomopt.optim.engine.engine import Engine
from geomopt.optim.engine.program import IMPLEMENTATIONS
from geomopt.optim.engine.masters import Masters
from geomopt.optim.engine.qkclip import QKClip
from geomopt.optim.persist import checkpoint
from geomopt.optim.persist.checkpoint import spec_hash
from geomopt.optim.persist.load_check import check_layout
from geomopt.optim.persist.migrate import MigrationReport
from geomopt.optim.units.directions import previous_gradients
from geomopt.optim.units.state_keys import direction_keys
from geomopt.spec.model import RESOLVED_DEFAULTS, Spec

__all__ = ["GeomOptimizer"]


class GeomOptimizer(Optimizer):
    """``GeomOptimizer(model_or_named_parameters, spec)``: spec is a Spec, a path or a dict.

    ``model_or_named_parameters`` may also be ``model.parameters()`` or param-group dicts (no
    per-group options: groups are the spec's rules), named by ``model=`` (by identity, roles from
    the model) or else ``param.<i>`` in order with roles guessed from shapes and a
    :class:`~geomopt.optim.contract.torch_api.GeneratedNamesWarning`
    (:func:`~geomopt.optim.contract.torch_api.collect_params`).

    ``lr``, ``weight_decay``: replace the spec's ``defaults:`` values; a rule that sets its own
    keeps it (:mod:`geomopt.optim.contract.torch_api`). Checked: finite, lr > 0, weight_decay ≥ 0. ``lr`` may
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
    as in torch) and step even when the others skip (:mod:`geomopt.optim.engine.nonfinite`).

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

    ``fuse`` (off by default): an elementwise rule with no direction or Polyak's and a map of each
    entry (sign descent, SGD) steps as one function compiled by ``torch.compile``
    (:mod:`geomopt.optim.engine.fused`): each gradient, momentum and parameter read once, the
    momentum and the parameters written once (eager: a pass per op). The first step compiles
    (seconds; a C++ compiler on CPU); the values are the eager step's to within float32 rounding of
    the momentum. With ``capturable`` the compiled loops take the gradients as they are and select
    them by the device's finiteness flag inside (no selected copy of G); other rules step as
    without it.

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
                 example_inputs=None, expect=None, capturable: bool = False, fuse: bool = False):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, not {implementation!r}")
        self.implementation = implementation
        self.spec = with_overrides(as_spec(spec), lr, weight_decay)
        infos, tensors, source, generated = collect_params(model_or_named_parameters, model,
                                                           needs_roles(self.spec, roles), example_inputs)
        self.plan: Plan = plan_from_infos(self.spec, infos, roles=roles)
        self.spec_hash = spec_hash(self.spec)
        if expect is not None:  # before anything is built or projected: a changed routing stops here
            check_routing(self.plan, expect, spec_hash=self.spec_hash, model=model_label(source))
        self.track_gap = track_gap
        self.track_update = track_update
        self.cuda_graphs = cuda_graphs
        self.capturable = capturable
        self.fuse = fuse
        groups, plans_by_group = [], []
        lr_tensor = tensor_lr(lr)  # a tensor lr=: the groups of the rules that take the default lr hold it
        for index, rule in enumerate(self.spec.rules):
            plans = [p for p in self.plan if p.rule_index == index]
            if not plans:
                continue
            first = plans[0]
            d = first.direction
            # every hyper-parameter a step reads lives here (one source of truth): the plan keeps
            # the operators and each tensor's radius factor
            coefficients = {k: v for k, v in d.items() if k in direction_keys()}
            groups.append(dict(
                params=[tensors[p.name] for p in plans], param_names=[p.name for p in plans], rule=rule.name,
                spec_hash=self.spec_hash, lr=first.lr if lr_tensor is None or rule.lr is not None else lr_tensor,
                weight_decay=first.weight_decay, radius=first.geometry.radius, direction=d.kind,
                alpha=d.get("alpha", 1.0), nesterov=d.get("nesterov", False), init=d.get("init", "zero"),
                **coefficients, schedule=first.schedule.model_dump(), on_nonfinite=first.on_nonfinite, step=0,
            ))
            plans_by_group.append(plans)
        self._building = True
        super().__init__(groups, dict(lr=RESOLVED_DEFAULTS["lr"], weight_decay=RESOLVED_DEFAULTS["weight_decay"]))
        self._building = False
        # the step's machinery (:mod:`geomopt.optim.engine.engine`); the model's parameter order (a
        # torch optimizer's state saved without names maps by it) and the names made up for
        # tensors given without one (a load matches them by position)
        self.engine = Engine(self.param_groups, plans_by_group, distributed=distributed, process_group=process_group,
                             track_gap=track_gap, track_update=track_update, cuda_graphs=cuda_graphs,
                             implementation=implementation, capturable=capturable, fuse=fuse,
                             order=([i.name for i in infos], [i.name for i in infos if i.requires_grad]),
                             generated_names=generated)
        warn_slow_bf16(self.spec, self.plan, tensors)
        warn_unused_rules(self.spec, infos)
        warn_guessed_roles(infos)
        self._qk_clip = QKClip(self.param_groups, plans_by_group, source, self.spec,  # geomopt.optim.engine.qkclip
                               executor=self.engine.executor)
        self._masters = Masters(self.param_groups, plans_by_group)  # geomopt.optim.engine.masters
        with self._masters.around(self.state, every=True):  # a compensated weight projects as its float32 value
            project_on_init(self.param_groups, plans_by_group, self.engine.executor)

    def describe(self) -> str:
        """Every bucket's step program (:mod:`geomopt.optim.engine.program`): its tensors, stages,
        variant and why each choice was made, as text (``geomopt plan … --program`` prints it)."""
        return self.engine.describe(self.spec.name, self.param_groups)

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
        return self.engine.executor.work

    # ------------------------------------------------------------ checkpoints, copies, diagnostics

    def state_dict(self) -> dict:
        """torch's state dict and what the spec set (``"geomopt"``:
        :func:`geomopt.optim.persist.checkpoint.saved_meta`); the post-hooks see the finished dict."""
        hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(hooks)()  # run below, on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = hooks
        sd["geomopt"] = checkpoint.saved_meta(self)
        for hook in hooks.values():
            out = hook(self, sd)
            sd = sd if out is None else out
        return sd

    # override: torch's returns None; this one also takes allow_spec_change / model and returns the
    # MigrationReport of a state carried over from another spec or optimizer
    def load_state_dict(self, state_dict: dict, *, allow_spec_change: bool = False,  # type: ignore[override]
                        model=None) -> Optional[MigrationReport]:
        """Load a checkpoint, refusing one saved under a different spec unless
        ``allow_spec_change=True`` (:func:`geomopt.optim.persist.checkpoint.load`: everything is
        checked and built first, then installed here at once); returns the
        :class:`~geomopt.optim.persist.migrate.MigrationReport` of a state carried over."""
        if not isinstance(state_dict, Mapping):
            check_layout(state_dict)  # raises, saying what a state dict is
        state_dict = dict(state_dict)  # shallow copy, as torch does; each pre-hook runs once (here)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            state_dict = state_dict if out is None else out
        loaded = checkpoint.load(self, state_dict, allow_spec_change=allow_spec_change, model=model)
        # install (nothing above wrote to the optimizer)
        if loaded.replace:
            self.__setstate__({"state": loaded.state, "param_groups": loaded.groups})
        else:  # a migration: the groups are written into this optimizer's
            self.state = defaultdict(dict, loaded.state)
            for group, new in zip(self.param_groups, loaded.groups):
                group.clear()
                group.update(new)
        self.engine.install(counters=loaded.counters, pending=loaded.pending, reset_buffers=not loaded.replace)
        self.engine.dispatch(self.param_groups)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
        return loaded.report

    def diagnostics(self, *, gap_reference: str = "auto") -> dict[str, dict]:
        """Per rule: gap, dual norm, violation, update norm, skipped steps and fallbacks
        (:func:`geomopt.optim.contract.diagnostics.diagnostics`)."""
        return diagnostics(self, gap_reference=gap_reference)

    def __getstate__(self) -> dict:
        """What pickle writes (:func:`geomopt.optim.contract.torch_api.pickled_state`)."""
        return pickled_state(self)

    def __deepcopy__(self, memo: dict):
        """A deep copy keeps views as views (deepcopy copies each storage once)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(copy_state(self), memo))
        return new

    def __setstate__(self, state: dict) -> None:
        """Also how ``load_state_dict`` installs ``state`` and ``param_groups`` into this
        optimizer: what :data:`~geomopt.optim.contract.torch_api.REBUILT` lists is made only where it is
        missing (a copy), never replaced (a sharded optimizer's layouts live in the runtime)."""
        super().__setstate__(state)  # torch's: hooks (empty where missing), the profiled step
        if self.engine.rt is None:  # a copy: its runtime is made anew
            self.engine.rt = self.engine.runtime(self.param_groups)

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
        if self.engine.options.keeps_prev:
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
        # compensated bf16 parameters step as their float32 weights (geomopt.optim.engine.masters)
        with torch.no_grad(), self._masters.around(self.state) as stepped:
            stepped[0] = self.engine.step(self.param_groups, self.state, g_prev)
            if stepped[0]:
                self._qk_clip.apply()  # QK-clip after the step (geomopt.optim.engine.qkclip)
        return loss

    @property
    def pending_step(self) -> Optional[dict]:
        """After a step that raised part-way: ``{"done": [names of the tensors whose update is
        written], "groups": [indices]}``; the next ``step()`` applies only the others. None
        otherwise."""
        return None if self.engine.pending is None else self.engine.pending.to_dict()
