"""The fused elementwise tail of a flat step (``GeomOptimizer(fuse=True)``): an elementwise rule's
direction, map, decay and write-back over its list of tensors, compiled by ``torch.compile``
(inductor) into kernels that read each gradient, state tensor and parameter once and write each
state tensor and parameter once — the memory-traffic floor of the step's elementwise part.

The compiled function is :func:`flat_tail`, written with the units' own list forms (the
direction's ``foreach`` and ``lookahead``, the geometry's ``elementwise_into``, the decay's
``in_place``), so no formula has a second copy here; inductor fuses what the eager step runs as
separate passes (d ← d.lerp(g, α), u = ∇φ₁*(d), X ← X(1 − γλ) + c·u) into one loop per tensor.
Its numbers are the eager step's to within float32 rounding: inductor's lerp rounds as its own
generated code does (at most 2 ulp of d apart, measured); the sign map and X's write have the
eager step's bits where the map is the sign (c·sign(d) is exact).

The coefficients (α, 1 − γλ, c = −γρ) enter as 0-d float64 tensors, so a schedule that changes
them every step compiles nothing again (Python numbers would be baked into the graph: one
compile per value, about 3 s each on a 2-core CPU, measured); each distinct list of shapes
compiles once (the first step, which starts the momentum, once more).

:func:`run` is the one place a compiled region is called: a byte counter at the dispatcher
(``benchmarks/traffic.py``) cannot see inside one, so it replaces :func:`run` to count the
region's inputs read once and its written inputs written once."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from geomopt.geometry.forward import elementwise_into, input_dtype
from geomopt.optim.units import stages as post_stages
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.directions import DIRECTIONS, polyak_lerp, polyak_lookahead_rows


def run(fn: Callable, out: list, written: list, read: list, *args) -> Any:
    """Call the compiled region ``fn(*out, *written, *read, *args)``: ``out`` the tensors it only
    writes, ``written`` those it writes in place (reading them too), ``read`` those it only reads
    (the declaration a byte counter reads). Each is a list of tensors (or of lists of them),
    passed detached: the same memory, written in place, as plain tensors (a parameter's shape is
    a constant to the compiler: one compile per shape)."""
    return fn(*(_detached(t) for t in (*out, *written, *read)), *args)


def _detached(t):
    return [_detached(x) for x in t] if isinstance(t, (list, tuple)) else t.detach()


def flat_tail(xs: list, ds: list, gs: list, alpha: torch.Tensor, keep: torch.Tensor, coef: torch.Tensor, *,
              direction: str, init: str, nesterov: bool, first: bool, geometry, decay: str, decays: bool) -> None:
    """One elementwise step over lists: d ← direction(d, g) (``ds`` empty: no direction, u = g),
    u = Nesterov's look-ahead where asked, X ← X·keep (``decays``) then X += coef·∇φ₁*(u); the
    same unit calls as :func:`geomopt.optim.engine.flat.step_flat`'s, on whole tensors (a
    compiler fuses them: nothing but X and d is written)."""
    hyper = {"alpha": alpha, "init": init, "nesterov": nesterov}
    meta = DIRECTIONS.meta[direction]
    if ds:
        meta["foreach"](ds, gs, hyper, first)
    us = list(ds) if ds else list(gs)
    if nesterov:
        us = [g.clone() for g in gs]
        for u, d in zip(us, ds):
            meta["lookahead"](u, d, hyper)
    write_tail(xs, [elementwise_into(u, geometry, torch.empty_like(u)) for u in us], keep, coef,
               decay=decay, decays=decays)


def write_tail(xs: list, steps: list, keep: torch.Tensor, coef: torch.Tensor, *, decay: str, decays: bool) -> None:
    """X ← X·keep (the decay's in-place form, ``decays``), then X += coef·S: the in-place
    write-back (compiled: one pass over X instead of two)."""
    if decays:
        DECAYS[decay].in_place(xs, keep)
    for x, s in zip(xs, steps):
        x.add_(s * coef)


def captured_flat_tail(xs: list, ds: list, gs: list, ok: torch.Tensor, alpha: torch.Tensor, keep: torch.Tensor,
                       coef: torch.Tensor, **fixed) -> None:
    """:func:`flat_tail` of a capturable step: the gradients selected by the device's finiteness
    flag ``ok`` (g where it is true, 0 elsewhere) inside the compiled loop, where the selection
    moves no memory (an eager step writes the selected copy: one more read and write of G); the
    coefficients come weighted by the flag (α·ok, 1 − γ·ok·λ, −γ·ok·ρ), so a skipped step writes
    d + 0·(0 − d), X·1 + 0·u: the values as they were."""
    flat_tail(xs, ds, [torch.where(ok, g, 0) for g in gs], alpha, keep, coef, **fixed)


def _compile(fn: Callable, **fixed) -> Callable:
    """``fn`` compiled whole, its fixed choices passed as keywords (constants the graph guards
    on). ``fn`` itself is compiled, not a partial of it: torch's cache and its recompile limit
    are per code object, and every partial shares one. Shapes specialize first and turn dynamic
    when a second one comes (torch's automatic dynamic shapes), so one more compile serves every
    bucket of a function: the tensors are given as plain tensors (:func:`run` detaches them),
    as parameters' shapes would stay static."""
    step = torch.compile(fn, fullgraph=True)

    def call(*args):
        return step(*args, **fixed)

    call.__name__ = fn.__name__  # the name a byte counter reports
    return call


@functools.lru_cache(maxsize=None)
def compiled(direction: str, init: str, nesterov: bool, first: bool, geometry, decay: str, decays: bool) -> Callable:
    """:func:`flat_tail` compiled for one rule's fixed choices."""
    return _compile(flat_tail, direction=direction, init=init, nesterov=nesterov, first=first, geometry=geometry,
                    decay=decay, decays=decays)


@functools.lru_cache(maxsize=None)
def compiled_captured(direction: str, init: str, nesterov: bool, first: bool, geometry, decay: str,
                      decays: bool) -> Callable:
    """:func:`captured_flat_tail` compiled for one rule's fixed choices."""
    return _compile(captured_flat_tail, direction=direction, init=init, nesterov=nesterov, first=first,
                    geometry=geometry, decay=decay, decays=decays)


@functools.lru_cache(maxsize=None)
def compiled_write(decay: str, decays: bool) -> Callable:
    """:func:`write_tail` compiled for one decay."""
    return _compile(write_tail, decay=decay, decays=decays)


@functools.lru_cache(maxsize=None)
def compiled_rows() -> Callable:
    """Nesterov's look-ahead read row by row (:func:`~geomopt.optim.units.directions.polyak_lookahead_rows`)
    compiled: d⁺ and u in one pass (each row of d and each gradient read once, u written once)."""
    return _compile(polyak_lookahead_rows)


def lookahead_rows(u: torch.Tensor, d: torch.Tensor, gs: list, alpha) -> torch.Tensor:
    """:func:`compiled_rows`, α as a graph input."""
    run(compiled_rows(), [u], [], [d, gs], scalar(alpha, u))
    return u


def captured_lookahead_tail(u: torch.Tensor, d: torch.Tensor, gs: list, ok: torch.Tensor, alpha) -> torch.Tensor:
    """:func:`~geomopt.optim.units.directions.polyak_lookahead_rows` on the gradients selected by
    the device's finiteness flag (g where ``ok``, 0 elsewhere) inside the compiled loop; α comes
    weighted by the flag (α·ok: a skipped step's u is d, finite)."""
    return polyak_lookahead_rows(u, d, [torch.where(ok, g, 0) for g in gs], alpha)


def captured_commit_tail(ds: list, gs: list, ok: torch.Tensor, alpha) -> None:
    """The put-off write of Polyak's d, d ← d.lerp(g, α·ok) row by row, on the gradients selected by
    the flag inside the compiled loop: a skipped step writes d + 0·(0 − d), d as it was."""
    polyak_lerp(ds, [torch.where(ok, g, 0) for g in gs], alpha)


@functools.lru_cache(maxsize=None)
def compiled_captured_rows() -> Callable:
    """:func:`captured_lookahead_tail` compiled: d⁺ and u in one pass, G selected in it."""
    return _compile(captured_lookahead_tail)


@functools.lru_cache(maxsize=None)
def compiled_captured_commit() -> Callable:
    """:func:`captured_commit_tail` compiled: d read and written once, G read once."""
    return _compile(captured_commit_tail)


def captured_lookahead(u: torch.Tensor, d: torch.Tensor, gs: list, alpha, *, ok: torch.Tensor) -> torch.Tensor:
    """:func:`lookahead_rows` of a capturable step: the gradients as they are and the flag ``ok``
    (:func:`compiled_captured_rows`)."""
    run(compiled_captured_rows(), [u], [], [d, gs, ok], scalar(alpha, u))
    return u


def captured_commit(ds: list, gs: list, alpha, *, ok: torch.Tensor) -> None:
    """Polyak's put-off write of a capturable step, compiled (:func:`compiled_captured_commit`)."""
    run(compiled_captured_commit(), [], [ds], [gs, ok], scalar(alpha, ds[0]))


def rows_calls(compiled: bool, ok, pp, group: dict, state: dict, g_prev, gs: list) -> tuple:
    """A bucket's Polyak momentum read row by row: (its gradients, the look-ahead and the put-off
    write of d to run; None: the eager ones). Not compiled: G and (None, None); compiled:
    :func:`lookahead_rows`. A capturable step's (``ok``, the device's flag): the gradients as they
    are, with :func:`captured_lookahead` and :func:`captured_commit`, where those loops are every
    read of them: Nesterov's look-ahead over d⁺ in a scratch of d's dtype, from the second step
    (the first makes d with eager ops), no post-stage reading the gradient, no previous gradient;
    else selected first (``torch.where``: eager ops turn 0·NaN into NaN)."""
    if not compiled or ok is None:
        return gs, lookahead_rows if compiled else None, None
    d = state.get("d")
    if (d is not None and bool(group["nesterov"]) and g_prev is None and input_dtype(pp.geometry, d) == d.dtype
            and not (pp.post and "gradient" in post_stages.reads(list(pp.post)))):
        return gs, functools.partial(captured_lookahead, ok=ok), functools.partial(captured_commit, ok=ok)
    return [torch.where(ok, g, 0) for g in gs], lookahead_rows, None


def scalar(value, like: torch.Tensor) -> torch.Tensor:
    """A coefficient as a 0-d float64 tensor on ``like``'s device (a graph input, never a constant)."""
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)
