"""The matrix polynomial iterations behind newton_schulz, gram_newton_schulz and polar_express.

Odd quintics p(X) = aX + (b·A + c·A²)X, A = XXᵀ, one per coefficient triple
(:mod:`geomopt.geometry.spectral` registers the approximations that run them), and the scalar map
they apply to each singular value (:func:`compose_polynomials`). Two forms compute the same map,
chosen by device (:func:`muon_order`): torch.optim.Muon's op sequence (the same bf16 bits on CPU)
and, elsewhere (CUDA), a copy-free form with pre-normalization, a·I and the output scale folded
into the small factors (:func:`_folded_iteration`). :func:`gram_quintic_iteration` iterates the
same map on the small Gram side.
"""

from __future__ import annotations

from contextlib import contextmanager
import threading
from typing import Callable, Iterator, Sequence, cast

import torch

from geomopt.support import Triple
from geomopt.geometry.matrix import working_dtype
from geomopt.geometry.prenorm import aol, aol_factors, aol_gram, by_norm, prenorm_factor, prenormalize
from geomopt.spec.geometries import NoPrenorm, Prenormalize

_NONE = NoPrenorm()  # no pre-normalization: what ``prenorm=None`` means here


def compose_polynomials(coefficients: Sequence[Triple], sigma: torch.Tensor) -> torch.Tensor:
    """The scalar map the iteration applies to each singular value: p_k ∘ … ∘ p_1(σ),
    p_i(x) = aᵢx + bᵢx³ + cᵢx⁵ (an odd polynomial, so the matrix iteration acts on σ alone)."""
    x = sigma
    for a, b, c in coefficients:
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x


# Devices where the iteration follows torch.optim.Muon's op sequence (pre-normalize X, transpose
# tall matrices into a copy so that A = XXᵀ is the small side, a·X added by the product's β): the
# same bf16 bits on CPU. Elsewhere (CUDA) :func:`_folded_iteration` computes the same map with no
# pass over X but the products (the passes it saves cost about a third of a GPT-2-small Muon
# step's elementwise time on an H100, benchmarks/RESULTS.md). Its bf16 error against float64 is
# no worse where σ spans three decades (0.84–0.97× Muon's) and up to 2.2× Muon's where σ spans
# one (a + (bA + cA²)ᵢᵢ rounded to bf16 loses the diagonal's low bits; Muon adds a·X in the
# product's fp32 epilogue, at the price of copying X into the output each step); tested.
_MUON_ORDER_DEVICES = ("cpu",)


#: whether this thread runs inside :func:`folded` (a thread's own flag: ``torch.compile`` traces a
#: read of it, where it cannot trace a ``ContextVar``)
_FOLDED = threading.local()


def muon_order(device: torch.device) -> bool:
    """Whether work on ``device`` follows torch.optim.Muon's op sequence (the same bits on CPU), or
    the shorter forms of :func:`_folded_iteration` and the optimizer's one-pass update (always
    inside :func:`folded`)."""
    return device.type in _MUON_ORDER_DEVICES and not getattr(_FOLDED, "on", False)


@contextmanager
def folded(first: Callable | None = None, last: list | None = None) -> Iterator[None]:
    """The iterations run inside it take :func:`_folded_iteration`'s form on every device: no
    pre-normalization pass (‖D‖²_F is the trace of the first Gram matrix, its factor folded into
    the first small factor) and no transposed copy of a tall matrix, for a step that gives up
    torch.optim.Muon's bits for fewer passes over X (``GeomOptimizer(fuse=True)``).

    ``first(gram, gram2, (a, b, c), scale, prenorm)``: what forms the first small factor
    (:func:`first_factor_into`, compiled: one pass over A and A², no scaling pass), where the
    pre-normalization is frobenius or max; with it the last factor's ``scale`` goes into the
    product's coefficients (bA + cA² and a, times the scale: no scaling pass either).

    ``last``: where an iteration whose result is in ``out_dtype`` already appends its last product
    (F, X, right) instead of running it, and returns X, the iterate before it (the caller
    accumulates F·X, or X·F for tall X, into its destination: :func:`geomopt.optim.engine.fused.
    write_product`, so the result is never written)."""
    before = getattr(_FOLDED, "on", False), getattr(_FOLDED, "first", None), getattr(_FOLDED, "last", None)
    _FOLDED.on, _FOLDED.first, _FOLDED.last = True, first, last
    try:
        yield
    finally:
        _FOLDED.on, _FOLDED.first, _FOLDED.last = before


def first_factor_into(out: torch.Tensor, sq: torch.Tensor, gram: torch.Tensor, gram2: torch.Tensor, a, b, c, scale,
                      *, prenorm: Prenormalize) -> None:
    """The first small factor of the folded iteration with its pre-normalization folded in, from the
    first Gram matrix A (B×k×k) and A² (``gram2``), into ``out``:

        C₀ = scale·f·(aI + b·f²A + c·f⁴A²),   f = :func:`prenorm_factor` (tr A),

    the factor F̂₁ of D̂ = f·D (Â = f²A) times f, so X₁ = C₀·D with no pass over D, nor over A or
    C₀ beyond this one (compiled: A and A² read once, C₀ written once). ``sq``: tr A = ‖D‖²_F per
    matrix (B,), summed in float32: finite exactly when every entry of D is (unless the squares
    overflow), the finiteness test of the iteration's input for free. Where ‖D‖²_F is past the
    dtype's range (entries past √max), f = 0 and A's overflowed entries times 0 are NaN: C₀ is 0
    there, the map of D/‖D‖ rounded through f = 0 (as :func:`gram_quintic_iteration` does)."""
    sq.copy_(gram.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32))
    f = cast(torch.Tensor, prenorm_factor(sq, prenorm)).to(gram.dtype)[:, None, None]
    f2 = f * f
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    c0 = (f * scale) * (eye * a + gram * (f2 * b) + gram2 * (f2 * f2 * c))
    out.copy_(torch.nan_to_num(c0, nan=0.0, posinf=0.0, neginf=0.0))


def odd_quintic_iteration(x: torch.Tensor, coefficients: Sequence[Triple], *, prenorm: Prenormalize | None = None,
                          overwrite: bool = False, scale: float = 1.0,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale``·p_k(…p_1(D̂)) in ``out_dtype`` (default: x's), D̂ = x pre-normalized by ``prenorm``
    (a :func:`prenormalize` cfg; None: none) and p(X) = aX + (b·A + c·A²)X, A = XXᵀ, per triple;
    tall matrices are transposed so A is the small side (the map commutes with transposition).
    ``overwrite``: x is the caller's scratch. On CPU the op sequence is torch.optim.Muon's
    (normalize, then addmm with beta/alpha), so in bf16 it reproduces
    ``_zeropower_via_newtonschulz`` exactly; on CUDA the same map is computed without copies or
    passes over X beyond the products (:data:`_MUON_ORDER_DEVICES`, :func:`_folded_iteration`)."""
    cfg = _NONE if prenorm is None else prenorm
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not muon_order(x.device):
        return _folded_iteration(x, coefficients, cfg, scale, out_dtype)
    use_aol = cfg.kind == "aol"
    X = x if use_aol else prenormalize(x, cfg, inplace=overwrite)
    m, n = X.shape[-2:]
    tall = m > n
    # contiguous: baddbmm's result takes its input's strides, so a transposed start would keep
    # every later product on the slow strided path
    if tall:
        X = _transposed_copy(X)
    lead = X.shape[:-2]
    mm_add: Callable[..., torch.Tensor]
    if X.ndim >= 3:
        X = X.reshape(-1, *X.shape[-2:])
        mm_add = torch.baddbmm
    else:
        mm_add = torch.addmm
    # AOL (Turbo-Muon's order): rescale the wide matrix's rows, and reuse its Gram matrix, rescaled,
    # for the first step
    first_gram = None
    if use_aol:
        X, first_gram = aol(X, cfg)
    for a, b, c in coefficients:
        gram = X @ X.mT if first_gram is None else first_gram
        first_gram = None
        update = mm_add(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        X = mm_add(X, update, X, beta=a)  # a·X + (b·A + c·A²)·X
    X = X.reshape(*lead, *X.shape[-2:])
    # tall: hand back the input's layout, so that the cast and the update that follow read memory
    # in order (a transposed view costs them a strided pass each)
    X = (_transposed_copy(X) if tall else X).to(out_dtype)
    return X if scale == 1.0 else X * scale


def _folded_iteration(x: torch.Tensor, coefficients: Sequence[Triple], prenorm: Prenormalize, scale: float,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`odd_quintic_iteration` with every scaling folded into the small factor
    F = aI + b·A + c·A² of a step, X ← X·F for tall X (A = XᵀX: nothing is transposed) and F·X
    otherwise (a product without an addend: baddbmm would first copy X into its output):

    - pre-normalization: ‖D‖²_F = tr(A₁), and with D̂ = f·D the first step is X₁ = (f·F̂₁)·D,
      F̂₁ built from A₁·f² (f = 1/(‖D‖_F + ε), or 1/max(‖D‖_F, ε)); no pass over D; AOL likewise,
      D̂ = S·D: X₁ = (F̂₁·S)·D, F̂₁ built from S·A₁·S (tall: D·(S·F̂₁));
    - ``scale`` multiplies the last F, and the last product writes ``out_dtype`` directly where
      the device's bmm can (fp32 from bf16 operands on CUDA: :func:`_bmm_into`)."""
    m, n = x.shape[-2:]
    right = m > n
    lead = x.shape[:-2]
    X = x.reshape(-1, m, n)
    use_aol = prenorm.kind == "aol"
    if not coefficients:
        if use_aol:
            return (prenormalize(X, prenorm) * scale).to(out_dtype).reshape(*lead, m, n)
        sq = (X.float() ** 2).sum(dim=(-2, -1))
        f = prenorm_factor(sq, prenorm)
        out = X * (scale if f is None else f[:, None, None] * scale)
        return out.to(out_dtype).reshape(*lead, m, n)
    last = len(coefficients) - 1
    s_aol = None
    first = getattr(_FOLDED, "first", None)  # fuse: C₀ by one compiled pass, the scale in the coefficients
    for i, (a, b, c) in enumerate(coefficients):
        gram = X.mT @ X if right else X @ X.mT
        factor: float | torch.Tensor = 1.0 if i < last else scale
        if i == 0 and first is not None and by_norm(prenorm):
            update = first(gram, gram @ gram, (a, b, c), factor, prenorm)  # C₀, pre-normalization folded in
            factor = 1.0
        else:
            if i == 0 and use_aol:
                s_aol = aol_factors(gram, prenorm)
                aol_gram(gram, s_aol)
            elif i == 0:
                f = prenorm_factor(gram.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32), prenorm)
                if f is not None:
                    # in the working dtype (bf16 on CUDA: rounded as torch Muon's bf16 norm is; a
                    # same-dtype product runs at 1.5× the speed of a mixed one, measured on an H100)
                    gram.mul_((f * f).to(gram.dtype)[:, None, None])
                    factor = (f * factor).to(gram.dtype)[:, None, None]
            if first is not None and isinstance(factor, float) and s_aol is None:  # scale·(aI + bA + cA²)
                a, b, c, factor = a * factor, b * factor, c * factor, 1.0
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
            update.diagonal(dim1=-2, dim2=-1).add_(a)
        if s_aol is not None:  # F̂·S (wide: S·D's rows), S·F̂ (tall: D·S's columns)
            update.mul_(s_aol.unsqueeze(-1) if right else s_aol.unsqueeze(-2))
            s_aol = None
        if not isinstance(factor, float) or factor != 1.0:
            update.mul_(factor)
        held = getattr(_FOLDED, "last", None) if i == last else None
        if i < last:
            X = X @ update if right else update @ X
        elif held is not None and X.dtype == out_dtype:  # the product left to the caller (folded's ``last``)
            held.append((update, X, right))
        else:
            X = _bmm_into(X, update, out_dtype) if right else _bmm_into(update, X, out_dtype)
    return X.reshape(*lead, m, n)


_OUT_DTYPE_BMM: dict = {}  # (device type, operand dtype, out dtype) → whether torch.bmm takes it


def _bmm_into(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b (batched) in ``out_dtype``: bf16 operands accumulate in fp32 in the matrix units
    either way, so where torch's bmm takes ``out_dtype`` (CUDA, torch ≥ 2.8) the product is
    written in fp32 directly, without rounding to bf16 and a cast pass; elsewhere it is rounded
    to the operands' dtype and cast."""
    if out_dtype == a.dtype:
        return a @ b
    key = (a.device.type, a.dtype, out_dtype)
    if _OUT_DTYPE_BMM.get(key, True):
        try:
            out = torch.bmm(a, b, out_dtype=out_dtype)
            _OUT_DTYPE_BMM[key] = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_BMM[key] = False
    return (a @ b).to(out_dtype)


def _transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """``x.mT`` as a contiguous tensor, matrix by matrix: torch's 2-D transpose copy is blocked,
    its batched one is not (CPU: about 2× faster for 1024×4096 bf16). Values are copied exactly."""
    m, n = x.shape[-2:]
    out = torch.empty(*x.shape[:-2], n, m, dtype=x.dtype, device=x.device)
    for src, dst in zip(x.reshape(-1, m, n), out.view(-1, n, m)):
        dst.copy_(src.mT)
    return out


def gram_quintic_iteration(x: torch.Tensor, coefficients: Sequence[Triple], *, prenorm: Prenormalize | None = None,
                           restarts: Sequence[int] = (2,), scale: float = 1.0,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`odd_quintic_iteration`'s map (``scale``·p_k(…p_1(D̂)), D̂ = x pre-normalized by
    ``prenorm``) iterated on the small Gram side (restarted Gram Newton–Schulz: Dao AI Lab,
    https://dao-lab.ai/blog/2026/gram-newton-schulz/, as microsoft/dion runs it). For X (m×n,
    m ≤ n) a step is X ← Q·X with Q = aI + P, P = bA + cA², A = XXᵀ; Q is a polynomial in A, so
    with X = R·X₀ only the m×m matrices are iterated:

        R ← Q·R,   A ← Q·A·Q   (= A·Q²: Q commutes with A)

    and the rectangular product X = R·X₀ is formed at the end and after each step of ``restarts``
    (1-based step numbers; there A = XXᵀ is recomputed from the new X and R starts again from I:
    the Gram recursion squares the conditioning, and restarting bounds how far rounding in A
    travels). Steps listed at or past the last are ignored. A step costs up to four m×m products
    (P; R ← Q·R unless R was just reset; A ← Q·A·Q, two, unless X is formed next) where
    newton_schulz's costs two m×m×n products and one m×m; the m×m×n products are the first Gram
    matrix, X and its Gram matrix at each restart, and X at the end (5 steps, restart after 2: 4
    against 10; it pays where m ≪ n, benchmarks/gram_ns.py). Tall matrices are read transposed
    (A = XᵀX, X ← X·Q, R accumulated on the right): nothing is copied.

    Accuracy: equal to newton_schulz to ≤ 2e-11 in float64; in float32 within its rounding on
    rectangular matrices, while on square ones (σ down to σ_max/n, squared in A) 8 steps with one
    restart lose 1e-3, restarts every two steps keep it at 4e-6 (tests/test_gram_newton_schulz.py).

    Pre-normalization and ``scale`` are folded into R: ‖D‖²_F = tr(A₀) (summed in at least
    float32, float64 for float64 work), A₀ is scaled by f² and the first Q by f
    (f = 1/(‖D‖_F + ε) or 1/max(‖D‖_F, ε)); AOL (D̂ = S·D) scales A₀ to S·A₀·S and the first Q to
    Q·S (tall: S·Q); ``scale`` multiplies the last R. The result is in
    ``out_dtype`` (default: x's)."""
    cfg = _NONE if prenorm is None else prenorm
    out_dtype = x.dtype if out_dtype is None else out_dtype
    m, n = x.shape[-2:]
    right = m > n  # tall: the n×n Gram XᵀX, products on the right
    lead = x.shape[:-2]
    X = x.reshape(-1, m, n)

    def gram(X: torch.Tensor) -> torch.Tensor:
        return X.mT @ X if right else X @ X.mT

    def times(R: torch.Tensor, X: torch.Tensor) -> torch.Tensor:  # R acting on X: R·X, or X·R for tall X
        return X @ R if right else R @ X

    A = gram(X)
    steps = len(coefficients)
    pending: torch.Tensor | None
    if cfg.kind == "aol":  # D̂ = S·D: A ← S·A·S, and S is folded into the first Q
        if steps == 0:
            return (prenormalize(X, cfg) * scale).to(out_dtype).reshape(*lead, m, n)
        s = aol_factors(A, cfg)
        aol_gram(A, s)
        pending = s.unsqueeze(-1) if right else s.unsqueeze(-2)  # S·Q (tall), Q·S (wide)
    else:
        sq = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=working_dtype(A.dtype))
        f = prenorm_factor(sq, cfg)
        pending = None if f is None else f.to(A.dtype)[:, None, None]  # folded into the first Q
        if pending is not None:
            # ‖D‖²_F past the dtype's range (entries past √max): f = 0, and the overflowed entries of
            # A times 0 are NaN; A·f² is 0 there, as is the map of D/‖D‖ rounded through f = 0
            torch.nan_to_num_(A.mul_(pending * pending), nan=0.0, posinf=0.0, neginf=0.0)
    if steps == 0:
        factor = scale if pending is None else pending * scale
        return (X * factor).to(out_dtype).reshape(*lead, m, n)
    restart_after = {int(r) for r in restarts}
    R = None
    for i, (a, b, c) in enumerate(coefficients, start=1):
        P = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        if R is None:  # R = Q (times the pending pre-normalization)
            R = P.clone() if i < steps and i not in restart_after else P
            R.diagonal(dim1=-2, dim2=-1).add_(a)
            if pending is not None:
                R.mul_(pending)
                pending = None
        else:  # R ← Q·R = aR + P·R (tall: R·Q)
            R = torch.baddbmm(R, R, P, beta=a) if right else torch.baddbmm(R, P, R, beta=a)
        if i == steps:
            break
        if i in restart_after:  # form X, recompute its Gram matrix, start R again
            X = times(R, X)
            A = gram(X)
            R = None
        else:  # A ← Q·A·Q: T = aA + P·A = Q·A, then A = aT + T·P = Q·A·Q
            T = torch.baddbmm(A, P, A, beta=a)
            A = torch.baddbmm(T, T, P, beta=a)
    R = cast(torch.Tensor, R)  # the last step (coefficients is not empty) set it
    if scale != 1.0:
        R = R * scale
    out = _bmm_into(X, R, out_dtype) if right else _bmm_into(R, X, out_dtype)
    return out.reshape(*lead, m, n)
