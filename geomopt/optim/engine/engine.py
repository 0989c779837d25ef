"""The engine: the one owner of a GeomOptimizer's step machinery.

:class:`Engine` holds what a step needs besides torch's ``param_groups`` and ``state``: each
group's plans and buckets, the step programs built from them (:mod:`geomopt.optim.engine.program`),
the executor and options, the per-group counters, the runtime (caches, scratch, CUDA graphs) and
an interrupted step's record. Its attributes and methods are its public interface: checkpoints
(:mod:`geomopt.optim.persist`), diagnostics and the torch contract (:mod:`geomopt.optim.contract`)
read and install through them; :class:`~geomopt.optim.engine.optimizer.GeomOptimizer` keeps
torch's shape (groups, state, hooks, ``step``) and delegates the rest here.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from geomopt.distributed.executors import LocalExecutor, ShardedExecutor, make_executor
from geomopt.distributed.layout import layout_key
from geomopt.geometry.capture import capturing
from geomopt.optim.contract.torch_api import check_complex, check_gradient, dense
from geomopt.optim.engine.atomic import PendingStep, drive, interrupted
from geomopt.optim.engine.bucket_step import BucketJob
from geomopt.optim.engine.capturable import captured_step, counts_on_device
from geomopt.optim.engine.construction import check_capturable, check_sharded
from geomopt.optim.engine.flat import step_flat
from geomopt.optim.engine.fused import in_ranges
from geomopt.optim.engine.nonfinite import launch_check, reads_traces, skip_nonfinite
from geomopt.optim.engine.owned import owners
from geomopt.optim.engine.program import Options, Program, dispatch, flat_rule, signature
from geomopt.optim.engine.runtime import Runtime
from geomopt.optim.engine.tensors import as_real, local, op_layout, op_view, stack
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units.schedules import step_size, typed_schedule
from geomopt.optim.units.state_keys import COUNTS, SPEC_KEYS, STACKED, direction_keys, owner_state
from geomopt.spec.model import Spec


def new_counters() -> dict:
    """A group's counters: steps skipped, backward steps that fell back to a projection, and the
    last step's ‖X⁺ − X‖² (``track_update``)."""
    return dict(skipped=0, fallbacks=torch.zeros((), dtype=torch.int64), update_sq=torch.zeros(()))


def copy_counters(c: dict) -> dict:
    # skipped: an int (a capturable step counts on the device: read here, off the step)
    return dict(c, skipped=int(c["skipped"]), fallbacks=c["fallbacks"].clone(), update_sq=c["update_sq"].clone())


def copy_value(value):
    """A copy of a group value; a tensor (an lr a scheduler keeps as a tensor) stays a tensor, not
    shared with the state dict it came from (torch's loader deep-copies the groups)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_value(v) for v in value]
    return value


def spec_values(group: dict) -> dict:
    """What the spec set in a group (saved with the state: after a spec change, values the new
    spec changed win over the checkpoint's): the spec's keys and the directions' coefficients."""
    return {k: copy_value(group[k]) for k in SPEC_KEYS + direction_keys() if k in group}


class Owner(Protocol):
    """What the modules around the engine read of the optimizer that owns it: torch's groups and
    state, the spec and its hash, and the engine."""

    param_groups: list
    state: Any
    spec: Spec
    spec_hash: str
    engine: "Engine"


class Engine:
    """Plans, buckets, programs, executor, options, counters, runtime and the pending step of one
    optimizer (see the module). ``order``: the model's parameter names (all, and those that
    train: a torch optimizer's state saved without names maps by it); ``generated_names``: names
    made up for tensors given without one (``param.<i>``: a load matches them by position)."""

    def __init__(self, groups: list, plans: list, *, distributed, process_group, track_gap: bool,
                 track_update: bool, cuda_graphs: bool, implementation: str, capturable: bool, fuse: bool = False,
                 order: tuple = ((), ()), generated_names=frozenset()):
        self.plans = plans
        self.order = order
        self.generated_names = generated_names
        self.pending: Optional[PendingStep] = None  # an interrupted step (:mod:`geomopt.optim.engine.atomic`)
        # what the spec set per group, saved with the state: after a spec change, values the new
        # spec changed win over the checkpoint's (load_state_dict)
        self.spec_groups = [spec_values(g) for g in groups]
        self.counters = [new_counters() for _ in groups]
        # same-(ops, shape, dtype, device) tensors of a group, and sharded ones of one mesh and
        # placements, are a bucket (zero-size tensors are in none: they never step)
        self.buckets: list = []
        for group, gplans in zip(groups, plans):
            by_key: dict = {}
            for i, p in enumerate(group["params"]):
                if p.numel():
                    by_key.setdefault((gplans[i].bucket, layout_key(p)), []).append(i)
            self.buckets.append(list(by_key.values()))
        # geomopt.distributed: LocalExecutor, ReplicatedExecutor or ShardedExecutor
        self.executor: Any = make_executor([p for g in groups for p in g["params"]], distributed, process_group,
                                           names=[pp.name for gplans in plans for pp in gplans])
        self.options = Options(
            local=isinstance(self.executor, LocalExecutor), sharded=isinstance(self.executor, ShardedExecutor),
            keeps_prev=any(DIRECTIONS[g["direction"]].keeps_prev for g in groups), track_gap=track_gap,
            track_update=track_update, cuda_graphs=cuda_graphs, implementation=implementation, capturable=capturable,
            fuse=fuse)
        check_capturable(groups, plans, self.options)
        check_sharded(groups, plans, self.options)
        self.rt: Optional[Runtime] = self.runtime(groups)
        check_complex(groups, plans, lambda g, pp: flat_rule(g, pp, self.options) is None)
        self.programs: list[list[Program]] = []
        self.built_from: list = []
        # each group's schedule as its typed spec model, and the group values it was read from
        # (a step reads it again where a group's value changed)
        self.schedules: list = []
        self.schedule_values: list = []
        self.read_schedules(groups)
        self.deferred = False
        self.dispatch(groups)

    def __getstate__(self) -> dict:
        """A copy keeps everything but the runtime (caches keyed by the original tensors' ids,
        scratch, CUDA graphs), which the copy's first use makes anew (:meth:`runtime`)."""
        return dict(self.__dict__, rt=None)

    def runtime(self, groups: list) -> Runtime:
        """The step's runtime (:mod:`geomopt.optim.engine.runtime`), with the sharded parameters'
        layouts as the operators see them (transposed for layout: in_out)."""
        rt = Runtime(self.executor, graph_cap=2 * sum(map(len, self.buckets)))
        # entries of the largest bucket (what a batched step stacks at once): bounds the flat path's blocks
        rt.largest_bucket = max((sum(g["params"][i].numel() for i in b)
                                 for g, bs in zip(groups, self.buckets) for b in bs), default=1)
        blocks = getattr(self.executor, "layouts", {})
        rt.stacked.layouts = {id(p): op_layout(blocks[id(p)], pp) for g, gplans in zip(groups, self.plans)
                              for p, pp in zip(g["params"], gplans) if id(p) in blocks}
        rt.owners = owners([(p, pp) for g, gplans in zip(groups, self.plans) for p, pp in zip(g["params"], gplans)
                            if p.numel() and owner_state(pp.geometry, self.options.sharded)], self.executor.world)
        return rt

    def dispatch(self, groups: list) -> None:
        """Build every bucket's step program (:func:`geomopt.optim.engine.program.dispatch`), and
        note the group values they were built from: a step builds them again when those change."""
        self.programs = dispatch(groups, self.plans, self.buckets, self.options)
        self.built_from = [signature(g) for g in groups]
        progs = [p for ps in self.programs for p in ps]  # not deferred where a rule is off
        self.deferred = (self.options.local and not self.options.keeps_prev and all(p.check != "off" for p in progs)
                         and all(p.check == "deferred" for p in progs if p.variant == "batched"))

    def read_schedules(self, groups: list) -> None:
        """Each group's schedule validated into its spec model (:func:`typed_schedule`), once per
        value: a step reads the model, and a value the spec refuses is refused before anything runs."""
        self.schedules = [typed_schedule(g) for g in groups]
        self.schedule_values = [copy_value(g["schedule"]) for g in groups]

    def refresh(self, groups: list) -> None:
        """Programs built again where a group's direction (or what else they read) changed; the
        schedules read again where a group's schedule changed."""
        if [signature(g) for g in groups] != self.built_from:
            self.dispatch(groups)
        if [g["schedule"] for g in groups] != self.schedule_values:
            self.read_schedules(groups)
        if self.rt is None:
            self.rt = self.runtime(groups)

    def install(self, *, counters: Optional[list] = None, pending: Optional[PendingStep] = None,
                reset_buffers: bool = False) -> None:
        """After a load: the saved counters (where given), the saved interrupted step (or None),
        the stacked-state caches dropped where the state was rebuilt; then the programs again."""
        if counters is not None:
            self.counters = [copy_counters(c) for c in counters]
        self.pending = pending
        if reset_buffers and self.rt is not None:
            self.rt.buffers.clear()

    def describe(self, spec_name: str, groups: list) -> str:
        """Every bucket's step program: its tensors, stages, variant and why each choice was made."""
        self.refresh(groups)
        off = all(p.check == "off" for progs in self.programs for p in progs)
        test = "off" if off else "deferred behind the forward ops" if self.deferred else "before any write"
        head = (f"spec '{spec_name}': {sum(map(len, self.programs))} step program(s); finiteness test "
                f"{test}; executor {type(self.executor).__name__}")
        return "\n".join([head] + [p.describe() for progs in self.programs for p in progs])

    # ------------------------------------------------------------ the step

    def step(self, groups: list, state, g_prev: dict) -> bool:
        """One step of every tensor with a gradient (``g_prev``: STORM's g(x_{k−1}, ξ_k) by
        tensor); False when it was skipped (a non-finite gradient) or left to a retry."""
        self.refresh(groups)
        rt = self.rt
        assert rt is not None
        jobs = self.jobs(groups, state)
        grads = [job_grads(prog, items) for prog, items in jobs]
        prevs = [stack([op_view(local(g_prev[p]), pp) for p, pp in items])
                 if all(g_prev.get(p) is not None for p, _ in items) else None for _, items in jobs]
        if self.options.capturable and jobs:
            done: list = []  # no host sync, the first step (creating the state) included
            counts_on_device(groups, state, self.counters, jobs)  # a no-op once they are
            try:
                captured_step(rt, groups, self.schedules, state, self.counters, jobs, grads, done)
            except BaseException as err:  # inside a CUDA-graph capture nothing ran: nothing is pending
                if not capturing():
                    self.pending = interrupted(self.pending, err, jobs, done, groups, self.plans, True)
                raise
            self.pending = None
            return True
        # deferred: the buckets launch their forward ops (reads into scratch) before the host
        # waits for the test, so the device stays busy; nothing is written before the wait; a
        # compiled bucket's test is its iteration's trace there (nonfinite.reads_traces: G not read)
        defer = self.deferred
        own = frozenset(k for k, (prog, _) in enumerate(jobs) if defer and reads_traces(prog))
        check = launch_check(rt, jobs, grads, prevs, own)  # None: no job is tested (on_nonfinite: off)
        if not defer:  # a skipped step still steps the jobs of on_nonfinite: off rules
            keep = skip_nonfinite(rt, groups, self.counters, jobs, check)
            if len(keep) < len(jobs):
                if not keep or self.pending is not None:  # an interrupted step's retry: all or nothing
                    return False
                jobs, grads, prevs = ([xs[k] for k in keep] for xs in (jobs, grads, prevs))
        schedules, devices = {}, {}
        for prog, items in jobs:
            gi = prog.group
            if gi not in schedules:
                gamma, alpha = step_size(groups[gi], self.schedules[gi])
                # a tensor lr is read once here (this step syncs anyway); a capturable step keeps it
                schedules[gi] = (float(gamma), alpha)
                devices[gi] = items[0][0].device

        pending = self.pending
        done = []  # indices of the jobs whose writes are complete (committed)

        def writes() -> bool:
            """Everything that writes at once; False when the step is skipped."""
            traces = {j: job.traces for j, job in steps if j in own} if defer else None  # those the check left out
            if defer and len(skip_nonfinite(rt, groups, self.counters, jobs, check, traces)) < len(jobs):
                return False  # deferred: every rule tested alike (dispatch), so the whole step
            if defer:  # a first factor whose A² cannot hold the step: that bucket's op again (fused.in_range)
                jobs_by = dict(steps)
                for j in in_ranges({j: job.ranges for j, job in steps if job.ranges}):
                    jobs_by[j].unfold = True
            if pending is None:  # a completed retry counts the whole step's update
                for gi, device in devices.items():
                    self.counters[gi]["update_sq"] = torch.zeros((), device=device)
            for j, ((prog, items), g) in enumerate(zip(jobs, grads)):
                if prog.variant == "flat":
                    step_flat(prog, rt, state, groups[prog.group], items, g, *schedules[prog.group])
                    done.append(j)
            # an encoded flat rule's chunk scratch (its moments' chunks, the codec's temporaries): not
            # held through the buckets' forward ops, which decode their own groups
            rt.workspace.drop(("codec.", "state."))
            return True

        try:
            if not defer:
                writes()
            shared = not defer and self.options.local  # buckets one after another
            steps = [(j, BucketJob(prog, rt, state, self.counters[prog.group], groups[prog.group], items,
                                   g, gp, *schedules[prog.group], shared=shared))
                     for j, ((prog, items), g, gp) in enumerate(zip(jobs, grads, prevs)) if prog.variant != "flat"]
            if not drive(self.executor.run, steps, done.append, writes if defer else None,
                         lockstep=not self.options.local):
                return False
        except BaseException as err:
            self.pending = interrupted(self.pending, err, jobs, done, groups, self.plans, self.options.local)
            raise
        for gi in set(schedules) | (pending.groups if pending is not None else set()):
            groups[gi]["step"] += 1
        self.pending = None
        if not self.options.capturable:  # a captured (or compiled) step reuses the scratch it took
            rt.workspace.release()  # nothing of the step's scratch is held between steps
        return True

    def jobs(self, groups: list, state) -> list:
        """(program, [(param, plan), …]) per call: a bucket's tensors that have a gradient (a
        zero-size tensor is in no bucket: it never steps nor gets state), split by state history
        (a tensor that missed steps has its own step counts). An elementwise rule's ``flat``
        buckets pool their tensors of one dtype, device and radius, whatever their shapes, into
        one flat call (:func:`geomopt.optim.engine.flat.step_flat`)."""
        jobs: list = []
        for group, plans, progs in zip(groups, self.plans, self.programs):
            for prog in progs:
                flat = prog.variant == "flat"
                by_key: dict = {}
                for i in prog.indices:
                    p = group["params"][i]
                    if p.grad is None or (self.pending is not None and id(p) in self.pending.done):
                        continue  # no gradient, or committed by an interrupted step this one completes
                    check_gradient(group, plans[i], p, p.grad)
                    st = state[p]
                    # the step counts by value (the host's, read off the CPU); a capturable step's
                    # device counts by identity (a bucket's tensors share one), with no host read
                    # state kept on a matrix's owner alone (a sharded tensor's kronecker factors) splits
                    # nothing: the other ranks, which hold none of it, must form the same jobs
                    held = owner_state(plans[i].geometry, self.options.sharded)
                    counts = tuple(st.get(k) if self.options.capturable or k not in st else int(st[k])
                                   for k in COUNTS if k not in held)
                    key: tuple = (tuple(sorted(k for k in st if k in STACKED and k not in held)), counts)
                    if flat:
                        key += (plans[i].radius_factor,)
                    by_key.setdefault(key, (prog, []))[1].append((p, plans[i]))
                jobs.extend(by_key.values())
        return jobs


def job_grads(prog: Program, items: list):
    """A job's gradients: stacked (batched ops), or a list (views, no copy) where the flat
    variant or a Polyak direction reads them tensor by tensor (the program's direction form)."""
    grads = [as_real(op_view(local(dense(p.grad)), pp)) for p, pp in items]
    if prog.variant == "flat" or prog.direction_form in ("rows", "ahead"):
        return grads
    return stack(grads)
