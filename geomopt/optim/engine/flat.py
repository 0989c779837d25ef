"""The flat variant of a step program (:mod:`geomopt.optim.engine.program`): an elementwise rule (φ
euclidean, anisotropic, isotropic or adam; no constraint, no post-stage) steps all its tensors,
whatever their shapes, with foreach kernels over flat state buffers, in blocks that stay in cache;
Adam through torch's fused AdamW kernel where the program is ``fused``."""

from __future__ import annotations

import functools
from typing import Any

import torch

from geomopt.geometry.adam import adam_multi_tensor
from geomopt.geometry.forward import elementwise_allocates, elementwise_in_place, elementwise_into, isotropic_factors
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.geometry.matrix import split_like
from geomopt.optim.engine import fused as tail
from geomopt.optim.engine.tensors import as_real, count_tensor, local, op_view
from geomopt.optim.engine.program import Program
from geomopt.optim.engine.runtime import Runtime

def step_flat(prog: Program, rt: Runtime, state, group: dict, items: list, grads: list, gamma: float,
              alpha) -> None:
    """One step of an elementwise rule with foreach kernels (the ``flat`` variant of a step
    program, :mod:`geomopt.optim.engine.program`): the state lives in flat buffers (per-parameter state
    entries are views of them), the forward map runs on flat memory, and the parameters are
    updated in place. Same arithmetic as :class:`~geomopt.optim.engine.bucket_step.BucketJob`, so the
    same bits, except adam where the program is ``fused`` (torch.optim.AdamW(fused=True)'s bits).

    u (the direction the map reads) is the gradients or the momentum themselves where the map
    only reads it, and then the step is one pass of each op over all tensors. Where something
    is written besides the state and the parameters (Nesterov's look-ahead, the sign map's
    output, unfused Adam's denominator) the whole step runs block by block
    (:func:`flat_blocks`: row ranges of at most :data:`BLOCK` entries, and of the largest
    bucket at most): each block's momentum, map and update follow each other while the block
    is in cache, and the scratch is one block of the workspace. Every op is elementwise, so
    blocks change no bit.

    A step never half-applies (:mod:`geomopt.optim.engine.atomic`): what it allocates (new state buffers,
    the scratch at its largest block, the fused kernel's count, the isotropic norms) is made
    before the first write, new state binds to its entries and the count advances after the
    last, so an exception (out of memory) leaves parameters and state as they were."""
    pp = items[0][1]
    geometry, kind = pp.geometry, pp.geometry.kind
    hyper = group if alpha is None else {**group, "alpha": alpha}  # α after a momentum warmup
    wd = group["weight_decay"]
    scale = -gamma * group["radius"] * pp.radius / geometry.radius
    xs = [as_real(op_view(local(p), q)) for p, q in items]  # complex: re, im as reals
    gs = grads  # operators' layout and real views already (the optimizer's job grads)
    # the momentum's flat buffer and views, where the rule has a direction (Any: the control
    # flow below, not the types, says where they are set)
    d: Any = None
    ds: Any = None
    binds: list = []  # new state buffers' bindings, and the count: after the last write
    # the direction's list form and look-ahead (:mod:`geomopt.optim.units.directions`: the same formulas
    # as every other form); a first step starts the momentum where the direction says
    meta = DIRECTIONS.meta[group["direction"]]
    nesterov = first = False
    if group["direction"] != "none":
        first = "d" not in state[items[0][0]]
        d, ds = rt.stacked.flat(state, items, xs, "d", binds)
        nesterov = bool(group["nesterov"])
    if prog.compiled:  # one compiled function over whole tensors (optim.engine.fused): no blocks, no scratch
        tail.run(tail.compiled(group["direction"], group["init"], nesterov, first, geometry, pp.decay, bool(wd)), [],
                 [xs, [] if ds is None else list(ds)], [gs], tail.scalar(hyper["alpha"], xs[0]),
                 tail.scalar(1 - gamma * wd, xs[0]), tail.scalar(scale, xs[0]))
        for bind in binds:
            bind()
        return
    adam = _adam_state(rt, state, items, xs, binds) if kind == "adam" else None
    fused = adam is not None and prog.fused and all(t.is_contiguous() for t in (*xs, *(gs if ds is None else ds)))
    writes = nesterov or kind == "anisotropic" or (adam is not None and not fused)
    # a map that allocates (the power barrier's (h*)') runs before any write: one block, the new
    # momentum staged in a scratch (as the isotropic norms), so an exception leaves every tensor as
    # it was; a map that cannot write over its input (the log barrier's) writes a second scratch
    whole = kind == "anisotropic" and elementwise_allocates(geometry)
    second = kind == "anisotropic" and not elementwise_in_place(geometry) and (nesterov or d is None)
    blocks: list[Any]
    if whole:
        blocks = [(None, 0, sum(x.numel() for x in xs))]
    elif not writes:
        blocks = [(None, 0, d.numel() if d is not None else None)]
    else:  # isotropic reads whole tensors (a norm each): blocks of whole tensors
        blocks = flat_blocks(xs, min(rt.largest_bucket, BLOCK) if kind != "isotropic" else rt.largest_bucket,
                             rows=kind != "isotropic")
    take = functools.partial(rt.workspace.take, dtype=xs[0].dtype, device=xs[0].device)
    largest = max((n if n is not None else sum(x.numel() for x in xs)) for _, _, n in blocks)
    # isotropic: its norms allocate after the new momentum is formed, so that is formed in a scratch
    staged = (kind == "isotropic" or whole) and d is not None
    for slot in scratch(kind, staged, nesterov, adam is not None and not fused, second):
        take(slot, (largest,))  # the workspace at its largest now: the blocks' takes reuse it
    steps_t = None if adam is None or not fused else torch.full((), adam[2], dtype=torch.float32, device=xs[0].device)
    factors = None
    if kind == "isotropic" and d is None:  # nothing is written before the norms: taken here
        factors = isotropic_factors(torch.stack(torch._foreach_norm(gs)), geometry)
    for pieces, off, n in blocks:
        cut = (lambda ts: ts) if pieces is None else functools.partial(cut_pieces, pieces=pieces)
        x_b, g_b = cut(xs), cut(gs)
        d_b: Any = None if d is None else cut(ds)
        d_new, d_views = (None, d_b) if d is None else (d[off:off + n], d_b)
        if staged:  # d⁺ formed in a scratch (the same ops, the same bits), written after the norms
            d_new = take("d", (n,))
            d_views = split_like(d_new, x_b)
            torch._foreach_copy_(d_views, d_b)
        if d is not None:
            meta["foreach"](d_views, g_b, hyper, first)
        u: Any
        u_views: Any
        if nesterov or (kind == "anisotropic" and d is None):
            u = take("u", (n,))
            u_views = split_like(u, x_b)
            torch._foreach_copy_(u_views, g_b)
            if nesterov:
                meta["lookahead"](u, d_new, hyper)
        elif d is not None:
            u, u_views = d_new, d_views
        else:
            u, u_views = None, g_b
        if adam is not None:
            (m, v, count) = adam
            adam_multi_tensor(x_b, u_views, m, v, count, pieces, off, geometry, gamma, wd, fused, take, steps_t)
            continue
        if kind == "isotropic":
            # ρ·(h*)'(‖D‖)/‖D‖·D per tensor (forward.isotropic), the factor applied in the axpy
            if factors is None:  # the norms of the new momentum, before it is written
                factors = isotropic_factors(torch.stack(torch._foreach_norm(u_views)), geometry)
            if staged:
                torch._foreach_copy_(d_b, d_views)
            if wd:
                DECAYS[pp.decay].in_place(x_b, 1 - gamma * wd)
            torch._foreach_addcmul_(x_b, u_views, list(factors.unbind(0)), value=scale)
            factors = None
            continue
        steps = u_views
        if kind == "anisotropic":
            if nesterov or d is None:  # u is a scratch: the map writes over it, or into a second one
                out = take("v", (u.numel(),)) if second else u
            else:
                out = take("u", (u.numel(),))
            elementwise_into(u, geometry, out)
            steps = split_like(out, x_b)
            if staged:  # everything that allocates has run: the momentum is written now
                torch._foreach_copy_(d_b, d_views)
        if wd:
            DECAYS[pp.decay].in_place(x_b, 1 - gamma * wd)
        axpy_lists(x_b, steps, scale)
    for bind in binds:
        bind()


def axpy_lists(xs: list, ys: list, coef) -> None:
    """xs += c·ys: one foreach add for a number c; for a 0-d tensor c (a capturable step's γ·ok) per
    tensor, with no host read of c (the same bits: c·y rounded once, then added)."""
    if torch.is_tensor(coef):
        for x, y in zip(xs, ys):
            x.addcmul_(y, coef)
    else:
        torch._foreach_add_(xs, ys, alpha=coef)


def _adam_state(rt: Runtime, state, items: list, xs: list, binds: list) -> tuple:
    """The flat Adam moments of a flat call (buffers and their per-tensor views) and the step
    number this step takes (the count is per parameter; a flat call's tensors share it: the
    optimizer splits its jobs by state history); new buffers and the count are written by
    ``binds``, after the step's writes."""
    step = int(state[items[0][0]].get("adam_step", 0)) + 1
    m = rt.stacked.flat(state, items, xs, "exp_avg", binds)
    v = rt.stacked.flat(state, items, xs, "exp_avg_sq", binds)
    tensor = count_tensor(step)  # one tensor for the call's tensors (a step replaces it, never writes into it)

    def count():
        for p, _ in items:
            state[p]["adam_step"] = tensor

    binds.append(count)
    return m, v, step


def scratch(kind: str, staged: bool, nesterov: bool, unfused_adam: bool, second: bool = False) -> tuple:
    """The workspace slots a flat step's blocks take (:func:`step_flat`): the look-ahead or the
    map's output ``u``, the map's output ``v`` where it cannot write over ``u`` (``second``), a
    staged momentum ``d``, unfused Adam's ``denom``."""
    slots = ("u",) if nesterov or (kind == "anisotropic") else ()
    return slots + (("v",) if second else ()) + (("d",) if staged else ()) + (("denom",) if unfused_adam else ())


#: entries of a block of the flat path (:func:`_blocks`): 4 MiB per float32 array, so a block's
#: parameters, gradients, state and scratch stay in cache (a 32 MiB L3) between its ops. Sign
#: descent on an HF GPT-2 (6.7M and 40M parameters, 2-core AVX2 CPU): 2^20 was 11–18% faster than
#: one pass of each op over everything; 2^16 and 2^18 lost that to per-block overhead, 2^22 to cache
BLOCK = 1 << 20



def flat_blocks(xs: list, cap: int, rows: bool = True) -> list:
    """The flat path's blocks over ``xs`` (in flat order): ``(pieces, offset, numel)`` with
    ``pieces`` a list of (tensor index, first row, end row) (rows None: the whole tensor) of at
    most ``cap`` entries (a row larger than that is a block of its own); ``rows=False`` keeps
    tensors whole (a tensor larger than ``cap`` is then a block of its own)."""
    out: list = []
    pieces: list = []
    off = n = 0

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


def cut_pieces(ts: list, pieces: list) -> list:
    """The ``pieces`` (:func:`flat_blocks`) of the tensors ``ts``."""
    return [ts[i] if a is None else ts[i][a:b] for i, a, b in pieces]
