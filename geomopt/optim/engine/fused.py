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

A batched bucket compiles its look-ahead (:func:`lookahead_rows_into`: d⁺ into a new d and u,
one pass over d and G) and its in-place write-back (:func:`write_tail`, or :func:`prox_tail`
with a constraint whose prox acts entry by entry), and runs its polynomial iteration eagerly in
the folded form (:func:`folding`); its post-stages, where each has a statistics form, become one
factor per row from one compiled read of U (:func:`post_by_rows`), which the write-back applies
(:func:`row_write_tail`, :func:`row_prox_tail`). Each region is one loop per tensor in inductor's generated
code, loading each input once and storing each output once (read from
``TORCH_LOGS=output_code`` on the CPU): the byte counter's declaration is what it moves.

The coefficients (α, 1 − γλ, c = −γρ) enter as 0-d float64 tensors, so a schedule that changes
them every step compiles nothing again (Python numbers would be baked into the graph: one
compile per value, about 3 s each on a 2-core CPU, measured); each distinct list of shapes
compiles once (the first step, which starts the momentum, once more).

:func:`run` is the one place a compiled region is called: a byte counter at the dispatcher
(``benchmarks/traffic.py``) cannot see inside one, so it replaces :func:`run` to count the
region's inputs read once and its written inputs written once."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from geomopt.geometry.capture import capturing
from geomopt.geometry.forward import elementwise_into, input_dtype
from geomopt.geometry.polynomial import first_factor_into, folded
from geomopt.geometry.prox import backward
from geomopt.optim.units import stages as post_stages
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.directions import DIRECTIONS, polyak_lerp, polyak_lookahead


def run(fn: Callable, out: list, written: list, read: list, *args) -> Any:
    """Call the compiled region ``fn(*out, *written, *read, *args)``: ``out`` the tensors it only
    writes, ``written`` those it writes in place (reading them too), ``read`` those it only reads
    (the declaration a byte counter reads). Each is a list of tensors (or of lists of them),
    passed detached: the same memory, written in place, as plain tensors (a parameter's shape is
    a constant to the compiler: one compile per shape)."""
    return fn(*(_detached(t) for t in (*out, *written, *read)), *args)


def _detached(t):
    if isinstance(t, dict):  # an encoded moment's stored entries (codes, scales, corrections) by key
        return {k: _detached(x) for k, x in t.items()}
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


def prox_tail(xs: list, steps: list, keep: torch.Tensor, coef: torch.Tensor, gamma: torch.Tensor, *, decay: str,
              decays: bool, geometry, constraint, rho: Optional[float]) -> None:
    """:func:`write_tail`, then X ← prox(X) in place: the backward op of ``constraint`` (with
    γ, ρ; ``rho`` None: nothing projects, a step of length 0) on each tensor, for a constraint whose
    backward op acts entry by entry (locality ``LOCAL``: proximal_decay's X⁺ = Y/(1 + γλ)), so the
    compiled region reads X and S once and writes X once, where the stacked write-back forms Y,
    maps it and copies it back (seven passes over X, four more)."""
    write_tail(xs, steps, keep, coef, decay=decay, decays=decays)
    if rho is not None:
        for x in xs:
            x.copy_(backward(x, gamma, geometry, constraint, radius=rho)[0])


def row_write_tail(xs: list, steps: list, factors: list, keep: torch.Tensor, coef: torch.Tensor, *, decay: str,
                   decays: bool) -> None:
    """:func:`write_tail` of the steps F⊙S, F a factor per row of each tensor (the rule's
    post-stages by rows, :func:`post_by_rows`): read beside S, no F⊙S formed."""
    write_tail(xs, [s * f for s, f in zip(steps, factors)], keep, coef, decay=decay, decays=decays)


def row_prox_tail(xs: list, steps: list, factors: list, keep: torch.Tensor, coef: torch.Tensor, gamma: torch.Tensor,
                  **fixed) -> None:
    """:func:`prox_tail` of the steps F⊙S (:func:`row_write_tail`)."""
    prox_tail(xs, [s * f for s, f in zip(steps, factors)], keep, coef, gamma, **fixed)


def write_back(xs: list, steps: list, keep: float, coef: float, gamma: float, *, decay: str, decays: bool, geometry,
               constraint, rho: Optional[float], factors: Optional[list] = None) -> None:
    """A batched bucket's in-place write-back, compiled: X ← X·keep + coef·S (:func:`write_tail`),
    then the constraint's entrywise prox where the rule has one (:func:`prox_tail`); the numbers
    enter as 0-d tensors (graph inputs). ``factors``: S's factor per row of each tensor (the
    post-stages by rows), applied in the same pass."""
    numbers = [scalar(keep, steps[0]), scalar(coef, steps[0])]
    read = [steps] if factors is None else [steps, factors]
    if constraint is None:
        run(compiled_write(decay, decays, factors is not None), [], [xs], read, *numbers)
    else:
        run(compiled_prox(decay, decays, geometry, constraint, rho, factors is not None), [], [xs], read, *numbers,
            scalar(gamma, steps[0]))


def write_product(xs: list, held: tuple, keep: float, coef: float) -> None:
    """X ← X·keep + coef·F·Xₖ (X ← X·keep + coef·Xₖ·F for tall X) per tensor of a bucket, where
    (F, Xₖ, tall) is the iteration's last small factor and iterate (stacked; ``held`` by
    :func:`folding`): the last product accumulates into each parameter through ``addmm_``'s β and
    α, so its result, a matrix as large as X, is never written and read back, and X is read and
    written once, inside the product. ``keep`` = 1 − γλ (a decay that only scales X:
    :attr:`~geomopt.optim.units.decays.DecayUnit.scales`), ``coef`` = −γρ."""
    factor, iterate, tall = held
    for x, f, it in zip(xs, factor.unbind(0), iterate.unbind(0)):
        if tall:
            x.addmm_(it, f, beta=keep, alpha=coef)
        else:
            x.addmm_(f, it, beta=keep, alpha=coef)


def row_squares_into(ss: torch.Tensor, u: torch.Tensor, *, dims: tuple) -> None:
    """ss = Σ U² over ``dims`` (kept), in float32 at least: one read of U (compiled)."""
    u = u.to(torch.promote_types(u.dtype, torch.float32))
    ss.copy_((u * u).sum(dim=dims, keepdim=True))


@functools.lru_cache(maxsize=None)
def compiled_squares(dims: tuple) -> Callable:
    """:func:`row_squares_into` compiled for one set of dims."""
    return compile_region(row_squares_into, dims=dims)


def post_by_rows(u: torch.Tensor, post: list, ctx: post_stages.Context, rows: bool = True) -> tuple:
    """A bucket's post-stages under fuse: (U, F) with F their factor per row
    (:func:`~geomopt.optim.units.stages.row_factor`) from U's per-row sums of squares, read in one
    compiled pass, for the write-back to apply (:func:`row_write_tail`), where every stage has a
    statistics form for the tensor (:func:`~geomopt.optim.units.stages.row_dims`) and ``rows``
    (a compiled program); else (the stages' result, None), as the eager step runs them."""
    dims = post_stages.row_dims(post, ctx) if rows else None
    if dims is None:
        return post_stages.run(u, post, ctx), None
    ss = u.new_empty([1 if d in dims else n for d, n in enumerate(u.shape)],
                     dtype=torch.promote_types(u.dtype, torch.float32))
    run(compiled_squares(dims), [ss], [], [u])
    return u, post_stages.row_factor(ss, post, ctx)


def folding(forward: Callable, traces: Optional[list] = None, first: bool = True,
            held: Optional[list] = None, ranges: Optional[list] = None) -> Callable:
    """A bucket's forward op run inside :func:`geomopt.geometry.polynomial.folded`: its polynomial
    iteration in the folded form on every device (no pre-normalization pass, no transposed copy
    of a tall matrix), its first small factor formed with the pre-normalization in one compiled
    pass (:func:`first_factor`) and the last one's scale in the product's coefficients, so nothing
    is scaled in a pass of its own. ``traces``: where each first factor's tr A = ‖u‖²_F per matrix
    is appended (the bucket's finiteness test: :func:`geomopt.optim.engine.nonfinite.traces_finite`).
    ``first`` False: the folded form's own scalings (a forward op replayed from a CUDA graph, where
    a compiled region is not captured). ``held``: where the iteration leaves its last product
    (:func:`geomopt.geometry.polynomial.folded`'s ``last``; the op then answers the iterate before
    it, for :func:`write_product`). ``ranges``: where each first factor's :func:`in_range` flags are
    appended (a matrix outside it is stepped again without the hook: :func:`in_ranges`)."""
    hook = functools.partial(first_factor, traces=traces, ranges=ranges) if first else None

    def call(m):
        with folded(hook, held):
            return forward(m)

    return call


def first_factor(gram: torch.Tensor, gram2: torch.Tensor, abc: tuple, scale: float, prenorm, *,
                 traces: Optional[list] = None, ranges: Optional[list] = None) -> torch.Tensor:
    """C₀ = scale·f·(aI + b·f²A + c·f⁴A²) from the first Gram matrix A and A² (batched), by
    :func:`geomopt.geometry.polynomial.first_factor_into` compiled (one loop over A and A² that
    writes C₀, after the trace's reduction over A's diagonal); the coefficients as 0-d graph inputs
    (one compile per shape, whatever the iteration's triple or a radius schedule's scale). tr A
    (float32, per matrix) is appended to ``traces`` where given, and whether each matrix is
    :func:`in_range` to ``ranges``."""
    out = torch.empty_like(gram)
    sq = torch.empty(gram.shape[0], dtype=torch.float32, device=gram.device)
    run(compiled_first(prenorm), [out, sq], [], [gram, gram2], *(scalar(v, gram) for v in (*abc, scale)))
    if traces is not None:
        traces.append(sq)
    if ranges is not None:
        ranges.append(in_range(sq, gram))
    return out


def in_range(sq: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per matrix, whether A² (the product of the un-normalized first Gram matrix A, k×k, with
    itself, which :func:`first_factor` takes) holds f⁴A² to the dtype's precision, from tr A = ‖D‖²_F:
    ‖A²‖_F ≤ ‖A‖²_F ≤ (tr A)², and every partial sum of the product too, so tr A ≤ √max/4 cannot
    overflow; ‖A²‖₂ = ‖A‖²₂ ≥ (tr A/k)², so tr A ≥ 16k·√(tiny/ε) keeps A²'s scale 2⁸ above the
    subnormals' error (float32: ‖D‖_F from about 4e-6·√k to 2e9). A matrix outside it (a gradient
    of norm past 2e9 would give C₀ = 0 after A²'s overflow) takes the folded form's own scaling
    (f² on A before its square), exact at every finite norm: :func:`in_ranges`."""
    info = torch.finfo(gram.dtype)
    lo, hi = 16 * gram.shape[-1] * (info.tiny / info.eps) ** 0.5, info.max ** 0.5 / 4
    return (sq >= lo) & (sq <= hi)


def in_ranges(ranges: dict) -> set:
    """The keys of ``ranges`` (a job → its forward op's :func:`in_range` flags) with a matrix out of
    range, in one read by the host."""
    keys = [k for k, flags in ranges.items() if flags]
    if not keys:
        return set()
    ok = torch.stack([torch.stack([f.all() for f in ranges[k]]).all() for k in keys]).tolist()
    return {k for k, good in zip(keys, ok) if not good}


@functools.lru_cache(maxsize=None)
def compiled_first(prenorm) -> Callable:
    """:func:`geomopt.geometry.polynomial.first_factor_into` compiled for one pre-normalization."""
    return compile_region(first_factor_into, prenorm=prenorm)


def captured_flat_tail(xs: list, ds: list, gs: list, ok: torch.Tensor, alpha: torch.Tensor, keep: torch.Tensor,
                       coef: torch.Tensor, **fixed) -> None:
    """:func:`flat_tail` of a capturable step: the gradients selected by the device's finiteness
    flag ``ok`` (g where it is true, 0 elsewhere) inside the compiled loop, where the selection
    moves no memory (an eager step writes the selected copy: one more read and write of G); the
    coefficients come weighted by the flag (α·ok, 1 − γ·ok·λ, −γ·ok·ρ), so a skipped step writes
    d + 0·(0 − d), X·1 + 0·u: the values as they were."""
    flat_tail(xs, ds, [torch.where(ok, g, 0) for g in gs], alpha, keep, coef, **fixed)


def compile_region(fn: Callable, dynamic: Optional[bool] = None, options: Optional[dict] = None, **fixed) -> Callable:
    """``fn`` compiled whole, its fixed choices passed as keywords (constants the graph guards
    on). ``fn`` itself is compiled, not a partial of it: torch's cache and its recompile limit
    are per code object, and every partial shares one. Shapes specialize first and turn dynamic
    when a second one comes (torch's automatic dynamic shapes), so one more compile serves every
    bucket of a function: the tensors are given as plain tensors (:func:`run` detaches them),
    as parameters' shapes would stay static. ``dynamic=True``: dynamic from the first call (one
    compile for every size: the codec's pieces); ``options``: inductor's settings for this function."""
    step = torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)

    def call(*args):
        return step(*args, **fixed)

    call.__name__ = fn.__name__  # the name a byte counter reports
    return call


@functools.lru_cache(maxsize=None)
def compiled(direction: str, init: str, nesterov: bool, first: bool, geometry, decay: str, decays: bool) -> Callable:
    """:func:`flat_tail` compiled for one rule's fixed choices."""
    return compile_region(flat_tail, direction=direction, init=init, nesterov=nesterov, first=first, geometry=geometry,
                          decay=decay, decays=decays)


@functools.lru_cache(maxsize=None)
def compiled_captured(direction: str, init: str, nesterov: bool, first: bool, geometry, decay: str,
                      decays: bool) -> Callable:
    """:func:`captured_flat_tail` compiled for one rule's fixed choices."""
    return compile_region(captured_flat_tail, direction=direction, init=init, nesterov=nesterov, first=first,
                          geometry=geometry, decay=decay, decays=decays)


@functools.lru_cache(maxsize=None)
def compiled_write(decay: str, decays: bool, rows: bool = False) -> Callable:
    """:func:`write_tail` (``rows``: :func:`row_write_tail`) compiled for one decay."""
    return compile_region(row_write_tail if rows else write_tail, decay=decay, decays=decays)


def lookahead_rows_into(us: list, news: list, ds: list, gs: list, alpha) -> None:
    """Per tensor of a bucket (lists of its rows), d⁺ = d.lerp(g, α) into ``news`` and Nesterov's
    u = g.lerp(d⁺, 1 − α) into ``us`` (:func:`~geomopt.optim.units.directions.polyak_lerp`,
    :func:`~geomopt.optim.units.directions.polyak_lookahead`): compiled, one loop per tensor that
    reads its row of d and its gradient once and writes d⁺ and u once. The rows are given as
    separate tensors (views of the stacked d⁺ and u): written through a row index inside the
    graph, or through a stack of the gradients, inductor would form the stacked result in a
    buffer of its own and copy it. The new d is bound when the bucket commits, so nothing live
    is written and no put-off update reads G a second time."""
    for u, new, d, g in zip(us, news, ds, gs):
        polyak_lerp(d, g, alpha, out=new)
        polyak_lookahead(g, new, alpha, out=u)


@functools.lru_cache(maxsize=None)
def compiled_prox(decay: str, decays: bool, geometry, constraint, rho: Optional[float], rows: bool = False) -> Callable:
    """:func:`prox_tail` (``rows``: :func:`row_prox_tail`) compiled for one decay, geometry,
    constraint and radius (a constant of the graph: a radius schedule compiles once per value; γ is
    an input)."""
    return compile_region(row_prox_tail if rows else prox_tail, decay=decay, decays=decays, geometry=geometry,
                          constraint=constraint, rho=rho)


@functools.lru_cache(maxsize=None)
def compiled_rows() -> Callable:
    """:func:`lookahead_rows_into` compiled."""
    return compile_region(lookahead_rows_into)


def lookahead_rows(u: torch.Tensor, new: torch.Tensor, d: torch.Tensor, gs: list, alpha) -> torch.Tensor:
    """:func:`compiled_rows` on the rows of the stacked u, d⁺ (``new``) and d; α as a graph input."""
    run(compiled_rows(), [list(u.unbind(0)), list(new.unbind(0))], [], [list(d.unbind(0)), gs], scalar(alpha, u))
    return u


def captured_lookahead_into(us: list, saved: list, ds: list, gs: list, ok: torch.Tensor, alpha) -> None:
    """:func:`lookahead_rows_into` of a capturable step, in place: d⁺ written into d itself (a
    captured step's state keeps its storage: a graph replays into it) and u, from the gradients
    selected by the device's finiteness flag (g where ``ok``, 0 elsewhere) inside the loop; α comes
    weighted by the flag (α·ok: a skipped step writes d + 0·(0 − d), d itself, and a finite u).
    ``saved`` (empty, or one tensor per row): d as it was, written by the same loop, which reads d
    anyway (the journal an interrupted step restores: one write, where a copy of d at the commit,
    or a journal's clone, would read d again)."""
    for s, d in zip(saved, ds):
        s.copy_(d)
    lookahead_rows_into(us, ds, ds, [torch.where(ok, g, 0) for g in gs], alpha)


@functools.lru_cache(maxsize=None)
def compiled_captured_rows() -> Callable:
    """:func:`captured_lookahead_into` compiled: d⁺ into d and u in one pass, G selected in it."""
    return compile_region(captured_lookahead_into)


def captured_lookahead(u: torch.Tensor, new: torch.Tensor, d: torch.Tensor, gs: list, alpha, *,
                       ok: torch.Tensor, saved: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`lookahead_rows` of a capturable step (:func:`compiled_captured_rows`), ``new`` d itself
    (:func:`~geomopt.optim.units.directions.polyak_rows` in place): the gradients as they are, the
    flag ``ok`` and ``saved``, where the loop writes d as it was (None: no journal)."""
    assert new is d  # d⁺ is written in place
    journal = [] if saved is None else list(saved.unbind(0))
    run(compiled_captured_rows(), [list(u.unbind(0)), journal], [list(d.unbind(0))], [gs, ok], scalar(alpha, u))
    return u


def rows_calls(compiled: bool, ok, pp, group: dict, state: dict, g_prev, gs: list) -> tuple:
    """A bucket's Polyak momentum read row by row: (its gradients, the look-ahead to run, the
    journal). The look-ahead: None (not compiled: the eager one) or :func:`lookahead_rows`, which
    writes d⁺ into a new d; the journal None. A capturable step's (``ok``, the device's flag): the
    gradients as they are, with :func:`captured_lookahead`, where that loop is every read of them
    (Nesterov's look-ahead, from the second step (the first makes d with eager ops), no post-stage
    reading the gradient, no previous gradient), which writes d⁺ into d in place, so the commit
    copies nothing; the journal then the (d, its copy as it was) pairs the bucket restores if the
    step is interrupted before its commit, none inside a capture (``torch.compile``, a CUDA graph),
    where nothing is restored (a graph that fails leaves nothing pending; a replayed graph does not
    fail). Else the gradients selected first (``torch.where``: eager ops turn 0·NaN into NaN)."""
    if not compiled or ok is None:
        return gs, lookahead_rows if compiled else None, None
    d = state.get("d")
    if (d is not None and bool(group["nesterov"]) and g_prev is None and input_dtype(pp.geometry, d) == d.dtype
            and not (pp.post and "gradient" in post_stages.reads(list(pp.post)))):
        saved = None if torch.compiler.is_compiling() or capturing() else torch.empty_like(d)
        return gs, functools.partial(captured_lookahead, ok=ok, saved=saved), [] if saved is None else [(d, saved)]
    return [torch.where(ok, g, 0) for g in gs], lookahead_rows, None


def scalar(value, like: torch.Tensor) -> torch.Tensor:
    """A coefficient as a 0-d float64 tensor on ``like``'s device (a graph input, never a constant)."""
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)
