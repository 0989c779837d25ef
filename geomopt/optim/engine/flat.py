"""The flat variant of a step program (:mod:`geomopt.optim.engine.program`): an elementwise rule (φ
euclidean, anisotropic, isotropic or adam; no constraint, no post-stage) steps all its tensors,
whatever their shapes, with foreach kernels over flat state buffers, in blocks that stay in cache;
Adam through torch's fused AdamW kernel where the program is ``fused``."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.geometry.adam import adam_multi_tensor
from geomopt.geometry.forward import elementwise_allocates, elementwise_in_place, elementwise_into, isotropic_factors
from geomopt.optim.persist.codes import BLOCK as CODEC_BLOCK, seed_of, signed, tables
from geomopt.optim.persist.state_codec import CHUNK, Codec, decode_piece, piece_of, shaped
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.state_keys import MOMENTS, SCALE, SIDE, geometry_state
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.geometry.matrix import split_like
from geomopt.optim.engine import fused as tail
from geomopt.optim.engine import fused_codec as codec_tail
from geomopt.optim.engine.tensors import as_real, count_tensor, local, op_view
from geomopt.optim.engine.program import Program
from geomopt.optim.engine.runtime import Runtime

def step_flat(prog: Program, rt: Runtime, state, group: dict, items: list, grads: list, gamma: float,
              alpha, ok: Optional[torch.Tensor] = None) -> None:
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
    if pp.state_dtype != "float32":
        return step_flat_encoded(prog, rt, state, group, items, grads, gamma, alpha)
    xs = [as_real(op_view(local(p), q)) for p, q in items]  # complex: re, im as reals
    # the momentum's flat buffer and views, where the rule has a direction
    d: Any = None
    ds: Any = None
    binds: list = []  # new state buffers' bindings, and the count: after the last write
    first = False
    if DIRECTIONS[group["direction"]].keys:  # the flat form's directions keep d alone
        first = "d" not in state[items[0][0]]
        d, ds = rt.stacked.flat(state, items, xs, "d", binds)
    adam = _adam_state(rt, state, items, xs, binds) if pp.geometry.kind == "adam" else None
    run_flat(prog, rt, group, pp, xs, grads, (d, ds), adam, first, gamma, alpha, ok=ok)
    for bind in binds:
        bind()


def run_flat(prog: Program, rt: Runtime, group: dict, pp: ParamPlan, xs: list, gs: list, momentum: tuple, adam,
             first: bool, gamma: float, alpha, count: Optional[torch.Tensor] = None,
             ok: Optional[torch.Tensor] = None) -> None:
    """:func:`step_flat`'s arithmetic (``pp``: the plan of the rule's tensors) on the parameters ``xs``
    with gradients ``gs`` (operators' layout, real views), the momentum ``momentum`` (flat buffer and
    views over ``xs``; (None, None) without a direction) and ``adam`` (the moments' (buffer, views)
    pairs and the step number; None off Adam), written in place; ``first``: the momentum's first step;
    ``count``: the fused kernel's step count (a float32 0-d tensor; None: made here, before any write);
    ``ok``: a capturable step's finiteness flag, which a compiled program selects its raw gradients by
    (:func:`~geomopt.optim.engine.fused.captured_flat_tail`; γ and α come weighted by it)."""
    geometry, kind = pp.geometry, pp.geometry.kind
    hyper = group if alpha is None else {**group, "alpha": alpha}  # α after a momentum warmup
    wd = group["weight_decay"]
    scale = -gamma * group["radius"] * pp.radius / geometry.radius
    meta = DIRECTIONS.meta[group["direction"]]
    d, ds = momentum
    nesterov = d is not None and bool(group["nesterov"])
    if prog.compiled and pp.state_dtype == "float32":  # one compiled function over whole tensors: no blocks, no scratch
        choices = (group["direction"], group["init"], nesterov, first, geometry, pp.decay, bool(wd))
        fn, read = (tail.compiled(*choices), [gs]) if ok is None else (tail.compiled_captured(*choices), [gs, ok])
        tail.run(fn, [], [xs, [] if ds is None else list(ds)], read, tail.scalar(hyper["alpha"], xs[0]),
                 tail.scalar(1 - gamma * wd, xs[0]), tail.scalar(scale, xs[0]))
        return
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
    steps_t = count
    if adam is not None and fused and count is None:
        steps_t = torch.full((), adam[2], dtype=torch.float32, device=xs[0].device)
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


def step_flat_encoded(prog: Program, rt: Runtime, state, group: dict, items: list, grads: list, gamma: float,
                      alpha) -> None:
    """:func:`step_flat` for a rule whose state is kept in a lower precision (``state: bfloat16 | int8
    | int8-ec``, :mod:`geomopt.optim.persist.state_codec`), chunk by chunk: the flat order of the
    call's tensors cut into chunks of at most the codec's CHUNK entries (:func:`encoded_chunks`,
    cuts within a tensor at multiples of its quantization block), and per chunk the moments decoded
    into the workspace, :func:`run_flat`'s arithmetic (torch's fused AdamW kernel where the float32
    state's program uses it), and the moments encoded back. The float32 copies a step holds are one
    chunk's, not the call's, and every op is elementwise and the codec's blocks and rounding bits
    are per entry, so chunks change no bit.

    The stored entries are written in place where they hold the rule's precision (new ones, made
    before the first write, are bound after the last: a first step, a checkpoint of another
    precision). Parameters must be float32 and contiguous (:func:`~geomopt.optim.engine.program.dispatch`)."""
    pp = items[0][1]
    codec = Codec(pp.state_dtype, step=group["step"])
    shapes = [tuple(op_view(local(p), q).shape) for p, q in items]
    xs = [op_view(local(p), q).view(-1) for p, q in items]
    gs = [g.reshape(-1) for g in grads]
    sts = [state[p] for p, _ in items]
    keys = DIRECTIONS[group["direction"]].keys + \
        (tuple(k for k in geometry_state(pp.geometry) if k in MOMENTS) if pp.geometry.kind == "adam" else ())
    first = "d" not in sts[0]
    binds: list = []
    # per tensor, per key: the stored form written (flat) and the entries read (as they are)
    targets = [{key: _target(codec, key, st, shape, xs[0].device, binds) for key in keys}
               for st, shape in zip(sts, shapes)]
    olds = [{k: st[k] for key in keys for k in (key, *(key + x for x in SIDE)) if k in st} for st in sts]
    seeds = [{key: [seed_of(q.name, codec.step, key)] for key in keys} for _, q in items]
    step = None
    if pp.geometry.kind == "adam":
        step = int(sts[0].get("adam_step", 0)) + 1
        tensor = count_tensor(step)  # one tensor for the call's tensors (a step replaces it, never writes into it)
        binds.append(lambda: [st.__setitem__("adam_step", tensor) for st in sts])
    # the largest chunk first: the workspace (the moments' chunks, run_flat's scratch, the codec's
    # temporaries) is at its largest before the first write, so nothing allocates after it
    chunks = sorted(encoded_chunks([x.numel() for x in xs], CHUNK), key=lambda c: -sum(b - a for _, a, b in c))
    largest = sum(b - a for _, a, b in chunks[0])
    device = xs[0].device
    take = rt.workspace.take
    Codec.reserve(take, largest, device)
    if prog.compiled:
        tables(device)  # constants of the compiled codec's graphs
    for key in keys:
        take("state." + key, (largest,), torch.float32, device)
    count = None if step is None else torch.full((), step, dtype=torch.float32, device=device)
    whole = None
    if prog.compiled and step is not None and not DIRECTIONS[group["direction"]].keys:
        whole = codec_tail.EncodedAdam(codec.dtype, pp, step, gamma, group["weight_decay"], device)
    for pieces in chunks:
        if whole is not None:  # a piece stored in place in the rule's precision: one compiled call, whole
            rest = []
            for i, a, b in pieces:
                if _in_place(targets[i], olds[i], keys):
                    whole(xs[i][a:b], gs[i][a:b], targets[i], a, seeds[i])
                else:
                    rest.append((i, a, b))
            if not rest:
                continue
            pieces = rest
        n = sum(b - a for _, a, b in pieces)
        x_b = [xs[i][a:b] for i, a, b in pieces]
        g_b = [gs[i][a:b] for i, a, b in pieces]
        bufs = {}
        for key in keys:
            buf = take("state." + key, (n,), torch.float32, device)
            views = split_like(buf, x_b)
            for (i, a, b), view in zip(pieces, views):
                if key in olds[i]:
                    _decode(prog.compiled, olds[i], key, a, b, view, take)
                else:
                    view.zero_()
            bufs[key] = (buf, views)
        adam = None if step is None else (bufs["exp_avg"], bufs["exp_avg_sq"], step)
        run_flat(prog, rt, group, pp, x_b, g_b, bufs.get("d", (None, None)), adam, first, gamma, alpha, count)
        for key in keys:
            for (i, a, b), view in zip(pieces, bufs[key][1]):
                target = targets[i][key]
                if isinstance(target, torch.Tensor):  # kept float32 (int8: a size not a multiple of its block)
                    target[a:b].copy_(view)
                elif prog.compiled:  # optim.engine.fused: one kernel, the same source and bits
                    tail.run(codec_tail.compiled_encode(codec.dtype, key), [], [piece_of(target, a, b)], [view],
                             torch.tensor(signed(seeds[i][key][0]), dtype=torch.int32, device=device),
                             torch.tensor(a, dtype=torch.int64, device=device))
                else:
                    codec.encode_piece(key, view, a, b, (1, xs[i].numel()), seeds[i][key], target, take)
    for bind in binds:
        bind()


def _in_place(targets: dict, olds: dict, keys: tuple) -> bool:
    """Whether a tensor's moments ``keys`` are written where they are read: every stored entry of each
    (:func:`_target`) the entry the state holds, in the rule's precision (not float32, not new)."""
    return all(isinstance(targets[key], dict) and all(k in olds and olds[k].data_ptr() == t.data_ptr()
                                                      for k, t in targets[key].items()) for key in keys)


def _decode(compiled: bool, stored: dict, key: str, a: int, b: int, out: torch.Tensor, take) -> None:
    """The float32 values of the entries [a, b) of a tensor's moment ``key`` (its ``stored`` entries)
    into ``out``: int8 codes decoded by one compiled kernel where ``compiled``
    (:func:`geomopt.optim.engine.fused_codec.decode_moment`), else (and bf16 or float32 values, a copy)
    :func:`~geomopt.optim.persist.state_codec.decode_piece`."""
    if compiled and key + SCALE in stored:
        own = {k: stored[k] for k in (key, *(key + x for x in SIDE)) if k in stored}
        tail.run(codec_tail.compiled_decode(key), [out], [], [piece_of(own, a, b)])
    else:
        decode_piece(stored, key, a, b, out, take)


def _target(codec: Codec, key: str, st: dict, shape: tuple, device, binds: list) -> "dict | torch.Tensor":
    """Where a tensor's moment ``key`` is written (flat; ``shape``: the tensor's, operators' layout):
    its stored entries themselves where they already hold the codec's form, else new ones bound to
    the state after the step's last write (the old entries are read until then); a float32 tensor
    where ``key`` stays float32."""
    numel = math.prod(shape)
    if not codec.stored(key, torch.empty(shape, device="meta")):
        old = st.get(key)
        if old is not None and old.dtype == torch.float32 and not any(key + x in st for x in SIDE) \
                and old.is_contiguous() and old.numel() == numel:
            return old.view(-1)
        new = torch.empty(numel, dtype=torch.float32, device=device)
        binds.append(lambda: _bind(st, key, {key: new.view(shape)}))
        return new
    form = codec.empty(key, numel, "meta")  # the stored form's dtypes and sizes, allocating nothing
    if all(k in st and st[k].dtype == v.dtype and st[k].numel() == v.numel() and st[k].is_contiguous()
           for k, v in form.items()) and not any(key + x in st and key + x not in form for x in SIDE):
        return {k: st[k].view(-1) for k in form}
    flat = codec.empty(key, numel, device)
    binds.append(lambda: _bind(st, key, {k: v[0] for k, v in shaped(flat, (1, *shape)).items()}))
    return flat


def _bind(st: dict, key: str, entries: dict) -> None:
    """A tensor's moment ``key`` bound to ``entries``, its side entries of another form dropped."""
    for side in SIDE:
        st.pop(key + side, None)
    st.update(entries)


def encoded_chunks(sizes: list, cap: int) -> list:
    """The chunks of :func:`step_flat_encoded`: lists of (tensor index, first entry, end entry) of at
    most ``cap`` entries over tensors of ``sizes`` in flat order, a tensor cut only at multiples
    of the codec's BLOCK (its int8 blocks lie within one chunk); ``cap`` a multiple of BLOCK."""
    out: list = []
    chunk: list = []
    n = 0
    for i, size in enumerate(sizes):
        a = 0
        while a < size:
            room = cap - n
            size_left = size - a
            k = size_left if size_left <= room else room // CODEC_BLOCK * CODEC_BLOCK
            if k == 0:
                out.append(chunk)
                chunk, n = [], 0
                continue
            chunk.append((i, a, a + k))
            n += k
            a += k
    if chunk:
        out.append(chunk)
    return out


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
