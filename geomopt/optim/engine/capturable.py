"""The capturable step: no host synchronization, so a step can be captured whole (a CUDA graph,
``torch.compile(opt.step, fullgraph=True)``).

Every step, the first one (which creates the state) included, :func:`captured_step` runs each
job with the finiteness flag on the device, so ``torch.compile(opt.step, fullgraph=True)`` can
start from the first call (a CUDA graph is still captured after a warm-up step, as torch's
optimizers are: the first step allocates the state): the gradients enter the operators as they
are where every one is finite and as zeros elsewhere (an SVD of NaNs raises; a copy selected by
``torch.where``, :func:`selected`, for a batched Polyak rule stacked as it is selected, except where
the program reads the flag itself: :func:`reads_flag`), and every write
(parameters, state, step counts) selects the new value where the flag is true and the old one
elsewhere (as fused AdamW's ``found_inf``), so a skipped step leaves every bit as it was (rules
with ``on_nonfinite: off``: not tested, they always step, a NaN propagating as in torch). Step
counts, the groups' ``step`` and the skipped counts are device tensors
(:func:`counts_on_device`), advanced by the flag; the spectral backward ops choose each matrix's
route on the device (:class:`~geomopt.geometry.prox.spectral_map.DeviceRoutes`). A first step
skipped for a non-finite gradient still creates the state, as the operators give it from zero
gradients (zero moments, counts 0), and leaves the parameters as they were.
"""

from __future__ import annotations

import torch

from geomopt.compile.fragments import ResolvedGeometry
from geomopt.geometry.adam import adam_hyper, adam_multi_tensor
from geomopt.geometry.prox.spectral_map import DeviceRoutes
from geomopt.geometry.reference import working_eps
from geomopt.optim.engine.atomic import drive
from geomopt.optim.engine.bucket_step import BucketJob
from geomopt.optim.engine.flat import step_flat
from geomopt.optim.engine.nonfinite import finite, finite_flags
from geomopt.optim.engine.runtime import Runtime
from geomopt.optim.engine.tensors import as_real, local, op_view
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units.schedules import step_size
from geomopt.optim.units.state_keys import COUNTS


def captured_step(rt: Runtime, groups: list, typed: list, state, counters: list, jobs: list, grads: list,
                  done: list) -> None:
    """One step of ``jobs`` ((program, [(param, plan)]) each, every program batched) with no host
    synchronization (``typed``: each group's schedule model); ``done`` collects the indices of the
    jobs that committed."""
    # jobs of on_nonfinite: off rules are not tested: their flag is a constant true (the gradient
    # enters as it is, a NaN propagates as in torch) and they step whatever the others' flag says
    tested = [j for j, (prog, _) in enumerate(jobs) if prog.check != "off"]
    first = grads[0][0] if isinstance(grads[0], list) else grads[0]
    true = torch.ones((), dtype=torch.bool, device=first.device)
    flags = [true] * len(jobs)
    if tested:
        for j, flag in zip(tested, finite_flags(rt, [grads[j] for j in tested], [None] * len(tested), finite)):
            flags[j] = flag
    ok = torch.stack([flags[j] for j in tested]).all() if tested else true
    oks = [ok if prog.check != "off" else true for prog, _ in jobs]
    # the operators run either way (the host does not know): on zeros where a gradient is
    # non-finite, and the writes select the old values
    zero = torch.zeros((), dtype=first.dtype, device=ok.device)
    # (a flat program's fused kernel reads the flag itself, and a compiled one selects inside its
    # loop: their gradients enter as they are)
    grads = [g if prog.check == "off" or reads_flag(prog) else selected(prog, g, ok, zero)
             for (prog, _), g in zip(jobs, grads)]
    schedules: dict = {}
    for prog, _ in jobs:
        gi = prog.group
        if gi not in schedules:
            schedules[gi] = step_size(groups[gi], typed[gi])
            counters[gi]["update_sq"].zero_()  # this step's sum, in place (a graph replays into it)
    for j, ((prog, items), g) in enumerate(zip(jobs, grads)):
        if prog.fused:
            captured_adam(rt, state, groups[prog.group], items, g, schedules[prog.group][0], oks[j])
            done.append(j)
        elif prog.variant == "flat":  # Polyak and a map of each entry, weighted by the flag
            gamma, alpha = schedules[prog.group]
            group = groups[prog.group]
            weight = oks[j].to(torch.float64)
            stateless = not DIRECTIONS[group["direction"]].keys  # no direction: no α
            alpha = None if stateless else (group["alpha"] if alpha is None else alpha) * weight
            step_flat(prog, rt, state, group, items, g, gamma * weight, alpha, ok=oks[j] if prog.compiled else None)
            done.append(j)
    steps = [(j, BucketJob(prog, rt, state, counters[prog.group], groups[prog.group], items, g, None,
                           schedules[prog.group][0], schedules[prog.group][1], shared=True, ok=oks[j]))
             for j, ((prog, items), g) in enumerate(zip(jobs, grads)) if prog.variant != "flat"]
    # the requests answered where they are (one process), not counted in opt.work (host numbers)
    with DeviceRoutes():
        drive(lambda requests: [r.fn(r.x) for r in requests], steps, done.append)
    for gi in schedules:  # counts on the device, advanced in place
        mine = [j for j, (prog, _) in enumerate(jobs) if prog.group == gi]
        bad = ~torch.stack([flags[j] for j in mine]).all()
        for holder, key, by in ((counters[gi], "skipped", bad), (groups[gi], "step", oks[mine[0]])):
            if isinstance(holder[key], torch.Tensor):
                holder[key].add_(by.to(torch.int64))
            else:
                holder[key] = by.to(torch.int64) + holder[key]


def reads_flag(prog) -> bool:
    """Whether a capturable program takes its gradients as they are and the finiteness flag beside
    them: torch's fused AdamW kernel (``found_inf``), a compiled flat step, which selects g where
    the flag is true and 0 elsewhere inside its loop (no selected copy of G is written), and a
    compiled bucket reading Polyak's momentum row by row, which does so in its look-ahead, the one
    loop that reads G (:func:`~geomopt.optim.engine.fused.rows_calls`; where another op would read
    G, the bucket selects it first). Every other program reads gradients zeroed where the flag is
    false (:func:`selected`): its eager ops would turn a weight of 0 on a NaN into a NaN (0·NaN)."""
    return prog.fused or (prog.compiled and (prog.variant == "flat" or prog.direction_form == "rows"))


def selected(prog, g, ok: torch.Tensor, zero: torch.Tensor):
    """The gradients ``g`` (a tensor or a list) of a program that does not read the flag itself,
    zeroed where it is false (``torch.where``: one read and one write of them); a program reading
    Polyak's momentum ahead (``direction ahead``) gets them stacked, the selection written into the
    stack's rows, so the step makes the one copy it reads three times (u = d.lerp(g, 1 − β²), and
    d ← d.lerp(g, α) at the commit) with no stacking pass of its own."""
    if not isinstance(g, list):
        return torch.where(ok, g, zero)
    if prog.direction_form != "ahead":
        return [torch.where(ok, t, zero) for t in g]
    out = torch.empty((len(g), *g[0].shape), dtype=g[0].dtype, device=g[0].device)
    for t, row in zip(g, out.unbind(0)):
        torch.where(ok, t, zero, out=row)
    return out


def captured_adam(rt: Runtime, state, group: dict, items: list, grads: list, gamma, ok: torch.Tensor) -> None:
    """A flat Adam call's capturable step (program ``flat · fused``): torch's fused AdamW kernel
    over the flat moments, as the eager flat step runs it (the same bits: the same kernel, the
    same lr and count values), with ``found_inf = 1 − ok`` (the kernel returns before any write
    where a gradient is not finite: the gradients are read as they are, nothing is selected) and
    the count advanced on the device by ``ok``, in place (one count shared by the call's tensors,
    which a captured step replays into). A first step creates the moments as zeros and the count
    0 + ok."""
    p0, pp = items[0]
    xs = [as_real(op_view(local(p), q)) for p, q in items]
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    binds: list = []
    m = rt.stacked.flat(state, items, xs, "exp_avg", binds)
    v = rt.stacked.flat(state, items, xs, "exp_avg_sq", binds)
    count = state[p0].get("adam_step")
    created = count is None
    if created:
        count = torch.zeros((), dtype=torch.int64, device=ok.device)
    steps = (count + 1).to(torch.float32)  # the kernel's bias corrections read this step's number
    if torch.is_tensor(gamma) and xs[0].device.type != "cpu":  # a device kernel reads a float32 lr on its device
        gamma = gamma.to(xs[0].device, torch.float32)  # (the CPU kernel reads any lr's value as a double)
    if torch.compiler.is_compiling():  # inductor cannot functionalize the fused kernel (torch 2.13)
        adam_weighted(xs, grads, m[1], v[1], steps, pp.geometry, gamma, group["weight_decay"], ok)
    else:
        adam_multi_tensor(xs, grads, m, v, None, None, 0, pp.geometry, gamma, group["weight_decay"], True, None, steps,
                          found_inf=(~ok).to(torch.float32))
    for bind in binds:
        bind()
    count.add_(ok.to(torch.int64))
    if created:
        for p, _ in items:
            state[p]["adam_step"] = count


def adam_weighted(xs: list, gs: list, ms: list, vs: list, steps: torch.Tensor, geometry: ResolvedGeometry, gamma,
                  wd: float, ok: torch.Tensor) -> None:
    """AdamW (``adam_moments``' formulas) tensor by tensor, for a compiler to fuse (inductor does not
    take torch's fused kernel): every write weighted by the flag ``ok`` on gradients zeroed where
    it is false, so a skipped step writes m + 0·(0 − m), v·1 + 0 and X·1 + 0, the values as they
    were. Within rounding of the fused kernel (another op order)."""
    beta1, beta2, eps = adam_hyper(geometry)
    eps = working_eps(eps, vs[0].dtype, norm=True)
    w = ok.to(torch.float64)
    step = steps.to(torch.float64)
    bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    for x, g, m, v in zip(xs, gs, ms, vs):
        g = torch.where(ok, g, 0)
        m.lerp_(g, (1 - beta1) * w)
        v.mul_(1 - (1 - beta2) * w).addcmul_(g, g * ((1 - beta2) * w))
        x.mul_(1 - gamma * wd * w).add_(m / (v.sqrt() / bc2_sqrt + eps) * (-gamma * w / bc1))


def counts_on_device(groups: list, state, counters: list, jobs: list) -> None:
    """Before every capturable step (a no-op once they are): the step counts (the groups', Adam's,
    the post-stages') and the skipped counts become device tensors, so the captured steps read
    and advance the same objects."""
    for prog, items in jobs:
        device = items[0][0].device
        for holder in (groups[prog.group], counters[prog.group]):
            for key in ("step", "skipped"):
                if key in holder and not isinstance(holder[key], torch.Tensor):
                    holder[key] = torch.tensor(holder[key], dtype=torch.int64, device=device)
        # the fallback count and the update's squared norm, on the device (a capture cannot copy
        # to the host), each advanced in place
        for key in ("fallbacks", "update_sq"):
            counters[prog.group][key] = counters[prog.group][key].to(device)
        for key in COUNTS:  # a job's tensors share one count: one device tensor for them
            values = [state[p][key] for p, _ in items if key in state[p]]
            if not values or (all(v is values[0] for v in values) and isinstance(values[0], torch.Tensor)
                              and values[0].device == device):
                continue  # already the job's shared device count (advanced in place by captured steps)
            shared = torch.tensor(int(values[0]), dtype=torch.int64, device=device)  # the host's count
            for p, _ in items:
                if key in state[p]:
                    state[p][key] = shared
