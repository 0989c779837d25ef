"""Scalar reference functions h (unit radius, domain |x| < 1 except quadratic), paper Section 2.

Each class gives h, h', (h*)', h* and the isotropic factor (h*)'(s)/s, elementwise on tensors.
A φ is built from h by :mod:`geomopt.geometry.forward` (separable, isotropic, spectral).
Construct from a spec fragment with :func:`make_reference`.

ε in the working dtype (the forward maps (h*)' and (h*)'(s)/s; the spec accepts any finite ε > 0,
and the maps must stay finite for every finite input): ε is used as the working dtype holds it
(:func:`working_eps`), floored at its smallest normal number ``tiny`` (elementwise (h*)'(y): at
y = 0 a smaller ε would round to 0 and give 0/0), or at √tiny for the isotropic factor, whose s
is a norm √Σx² in that dtype: squares below ``tiny`` are lost there, so a group whose entries are
all below √tiny can have s = 0, and a factor 1/(ε + s) with a smaller ε would blow such entries
up far past the bound (h*)' ≤ 1 of a bounded reference. With the floor every entry of
(h*)'(s)/s·x stays ≤ 1 in magnitude. The maps change only where |y| (s) is within ~2²⁴ of the
floor (float32: |y| < 2e-31, s < 2e-12), toward the indicator's value that ε → 0 tends to.
An ε above the working dtype's largest finite value is +∞ there: the maps are 0 (for float32 the
rounding of |y|/ε to 0 wherever ε > 2.4e83). The log barrier's h and h* (the stationarity gap's
terms) read ε the same way, with h*(y) = |y| to rounding where |y|/ε overflows.
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar, cast

import torch

from geomopt.registry import Registry
from geomopt.spec.geometries import Reference as ReferenceSpec

#: reference kind → its class (``make_reference`` builds one from a spec fragment)
REFERENCES = Registry("reference")

_R = TypeVar("_R", bound="Reference")


def reference(kind: str) -> Callable[[type[_R]], type[_R]]:
    """Register a :class:`Reference` subclass under ``kind`` (also its ``kind`` attribute)."""
    def register(cls: type[_R]) -> type[_R]:
        cls.kind = kind
        return REFERENCES.register(kind)(cls)

    return register


def make_reference(cfg: ReferenceSpec) -> "Reference":
    """A spec reference (``power_barrier(kappa=4, eps=1e-3)``) → a :class:`PowerBarrier`: the
    class of its ``kind``, its other fields the parameters."""
    return REFERENCES[cfg.kind](**{k: v for k, v in cfg.__dict__.items() if k != "kind"})


def working_eps(eps: float, dtype: torch.dtype, *, norm: bool = False) -> float:
    """ε as the maps use it in ``dtype`` (module docstring): at least ``tiny`` (``norm``: √tiny,
    for the isotropic factor of a norm), +∞ above the dtype's largest finite value (a Python
    float: torch refuses scalars that overflow the tensor's dtype in some ops)."""
    info = torch.finfo(dtype)  # no cache: torch.compile traces this (finfo folds to constants)
    if eps > info.max:
        return math.inf
    return max(float(eps), math.sqrt(info.tiny) if norm else info.tiny)


class Reference:
    """h with its derivatives; ``kappa`` is None for the quadratic, ∞ for the indicator."""

    kind: str = ""
    eps: float = 0.0
    kappa: float | None = None
    bounded = True  # dom h = [−1, 1] (barriers, indicator) rather than ℝ
    #: :meth:`dual_grad_into` allocates (no allocation-free form): a caller that must not allocate
    #: after its first write computes it first (the optimizer's flat path)
    into_allocates = True
    #: :meth:`dual_grad_into` may write over its input (``out`` is ``y``) without allocating
    into_in_place = True

    def h(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dh(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dual_grad(self, y: torch.Tensor) -> torch.Tensor:
        """(h*)'(y)."""
        raise NotImplementedError

    def dual_grad_into(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """(h*)'(y) written into ``out`` (which may be ``y``): the optimizer's allocation-free
        form for elementwise steps; references with a one-kernel (h*)' override it."""
        return out.copy_(self.dual_grad(y))

    def iso_factor(self, s: torch.Tensor) -> torch.Tensor:
        """(h*)'(s)/s for s ≥ 0, evaluated without forming y/|y| (finite at s = 0)."""
        raise NotImplementedError

    def conj(self, y: torch.Tensor) -> torch.Tensor:
        """h*(y)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eps={self.eps}, kappa={self.kappa})"


@reference("log_barrier")
class LogBarrier(Reference):
    """h(x) = −ε(ln(1−|x|)+|x|), h'(x) = εx/(1−|x|), (h*)'(y) = y/(ε+|y|),
    h*(y) = |y| − ε·ln(1+|y|/ε) (paper Example 2.6)."""

    kappa = 1.0

    def __init__(self, eps: float = 1e-8):
        self.eps = float(eps)

    def h(self, x):
        # −ln(1−a) − a = g(−a) with g(z) = z − ln(1+z): no cancellation near 0; +∞ off the domain.
        a = x.abs()
        e = working_eps(self.eps, a.dtype)
        if math.isinf(e):  # ε past the dtype's range: h = δ_{0}
            return torch.where(a == 0, torch.zeros_like(a), torch.full_like(a, math.inf))
        out = e * _z_minus_log1p(-a.clamp(max=1))
        return torch.where(a >= 1, torch.full_like(out, math.inf), out)

    def dh(self, x):
        return self.eps * x / (1 - x.abs())

    def dual_grad(self, y):
        return y / (working_eps(self.eps, y.dtype) + y.abs())

    into_allocates = False
    into_in_place = False  # ε + |y| needs y's signs: over y itself it takes a temporary

    def dual_grad_into(self, y, out):
        """y/(ε + |y|) in two passes over ``out`` (the same bits as :meth:`dual_grad`); ``out`` is
        y: through a temporary."""
        if out is y:
            return out.copy_(self.dual_grad(y))
        torch.abs(y, out=out).add_(working_eps(self.eps, y.dtype))
        return torch.div(y, out, out=out)

    def iso_factor(self, s):
        return 1 / (working_eps(self.eps, s.dtype, norm=True) + s)

    def conj(self, y):
        # |y| − ε ln(1+|y|/ε) = ε·g(|y|/ε): the series branch keeps digits for |y| ≪ ε. Where |y|/ε
        # overflows, ε·ln(1+|y|/ε) < 10³ε is below the rounding of |y|: h*(y) = |y|.
        a = y.abs()
        e = working_eps(self.eps, a.dtype)
        if math.isinf(e):  # ε past the dtype's range: h* = 0
            return torch.zeros_like(a)
        z = a / e
        return torch.where(torch.isinf(z), a, e * _z_minus_log1p(z))


@reference("power_barrier")
class PowerBarrier(Reference):
    """h'(x) = εx/(1−|x|^κ)^{1/κ}, (h*)'(y) = y/(ε^κ+|y|^κ)^{1/κ},
    h(x) = ε(x²/2)·₂F₁(2/κ,1/κ;1+2/κ;|x|^κ), h*(y) = ∫₀^{|y|} s(ε^κ+s^κ)^{−1/κ} ds
    (κ = 2: h = ε(1−√(1−x²)), h* = √(ε²+y²)−ε). κ = 4 models Newton–Schulz / Polar Express
    (paper Appendix F, Theorem 4.7)."""

    def __init__(self, kappa: float = 4.0, eps: float = 1e-3):
        self.kappa = float(kappa)
        self.eps = float(eps)

    def dh(self, x):
        k = self.kappa
        # 1 − |x|^κ = −expm1(κ·log|x|) keeps digits near the boundary.
        return self.eps * x / (-torch.expm1(k * torch.log(x.abs()))).pow(1 / k)

    def dual_grad(self, y):
        return y * self._factor(y.abs(), working_eps(self.eps, y.dtype))

    def iso_factor(self, s):
        return self._factor(s, working_eps(self.eps, s.dtype, norm=True))

    def _factor(self, s: torch.Tensor, e: float) -> torch.Tensor:
        """(e^κ + s^κ)^{−1/κ} for e > 0 (+∞: 0), s ≥ 0 (+∞ included: 0)."""
        if math.isinf(e):
            return torch.zeros_like(s)
        k = cast(float, self.kappa)  # a float for the power barrier
        # (ε^κ + s^κ)^{−1/κ} = 1/(m·(1 + (min/max)^κ)^{1/κ}) with m = max(ε, s): no overflow.
        m = torch.clamp(s, min=e)
        r = torch.clamp(s, max=e) / m
        return 1 / (m * (1 + r.pow(k)).pow(1 / k))

    def h(self, x):
        return _power_barrier_h(x, self.kappa, self.eps)

    def conj(self, y):
        return _power_barrier_conj(y, self.kappa, self.eps)


@reference("indicator")
class Indicator(Reference):
    """h = δ_[−1,1] (the ε→0 limit of either barrier): (h*)'(y) = sign(y) (0 at 0), h*(y) = |y|.
    ∇φ* is then the lmo (Muon, Scion); the Fenchel–Young gap is not available."""

    kappa = math.inf

    def h(self, x):
        return torch.where(x.abs() <= 1, torch.zeros_like(x), torch.full_like(x, math.inf))

    def dh(self, x):
        return torch.zeros_like(x)

    def dual_grad(self, y):
        return torch.sign(y)

    into_allocates = False

    def dual_grad_into(self, y, out):
        return torch.sign(y, out=out)

    def iso_factor(self, s):
        return torch.where(s > 0, 1 / s, torch.zeros_like(s))

    def conj(self, y):
        return y.abs()


@reference("quadratic")
class Quadratic(Reference):
    """h(x) = x²/2 = h*(x): the Euclidean reference, (h*)' = identity."""

    kappa = None
    eps = 1.0
    bounded = False

    def h(self, x):
        return 0.5 * x * x

    dh = staticmethod(lambda x: x)
    dual_grad = staticmethod(lambda y: y)

    into_allocates = False

    def dual_grad_into(self, y, out):
        return y if out is y else out.copy_(y)

    def iso_factor(self, s):
        return torch.ones_like(s)

    def conj(self, y):
        return 0.5 * y * y


def _z_minus_log1p(z: torch.Tensor) -> torch.Tensor:
    """g(z) = z − ln(1+z) for z ≥ −1, accurate to a few ulps: the Taylor series Σ_{j≥2} (−z)^j/j
    for |z| < 0.1 (where the difference cancels), the direct formula elsewhere."""
    zs = z.clamp(-0.1, 0.1)
    poly = torch.full_like(z, 1 / 24)
    for j in range(23, 1, -1):  # Horner: Σ_{j=2}^{24} (−1)^j z^j / j = z²·(c₂ + z(c₃ + …))
        poly = poly * zs + (-1) ** j / j
    series = poly * zs * zs
    direct = z - torch.log1p(z)
    return torch.where(z.abs() < 0.1, series, direct)


# ---------------------------------------------------------------- power barrier by quadrature
#
# h and h* of the power barrier have no elementary closed form for general κ. Both are
# ∫ of an explicit integrand, evaluated with a fixed Gauss–Legendre rule after substitutions that
# make the integrand smooth (so 64 nodes reach double precision), in float64 whatever the input
# dtype. κ = 1 (log barrier) and κ = 2 use their closed forms.

_GL_NODES = 64
_SPLIT = 0.5  # h: direct rule on [0, min(|x|, ½)], boundary substitution on [½, |x|]


def _gauss_legendre(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights on [0, 1] (Golub–Welsch: eigenvalues of the Jacobi matrix)."""
    k = torch.arange(1, n, dtype=torch.float64)
    off = k / torch.sqrt(4 * k * k - 1)
    jac = torch.diag(off, 1) + torch.diag(off, -1)
    nodes, vecs = torch.linalg.eigh(jac)
    weights = 2 * vecs[0] ** 2
    return ((nodes + 1) / 2).to(device), (weights / 2).to(device)


_GL_CACHE: dict = {}


def _rule(device) -> tuple[torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _GL_CACHE:
        _GL_CACHE[key] = _gauss_legendre(_GL_NODES, device)
    return _GL_CACHE[key]


_CHUNK = 1 << 15  # elements per quadrature batch: bounds the (chunk, nodes) float64 temporaries


def _chunked(fn, a: torch.Tensor) -> torch.Tensor:
    """fn applied to ``a`` in flat chunks, so h of a large tensor (anisotropic gap) does not
    allocate numel × nodes floats at once."""
    if a.numel() <= _CHUNK:
        return fn(a)
    flat = a.reshape(-1)
    return torch.cat([fn(part) for part in flat.split(_CHUNK)]).reshape(a.shape)


def _integrate(f, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """∫_lo^hi f(t) dt elementwise (lo, hi broadcast; f maps a (..., n) tensor of nodes)."""
    u, w = _rule(lo.device)
    t = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * u
    return (hi - lo) * (f(t) * w).sum(-1)


def _power_barrier_h(x: torch.Tensor, kappa: float, eps: float) -> torch.Tensor:
    """h(x) = ε∫₀^{|x|} s(1−s^κ)^{−1/κ} ds = ε(x²/2)·₂F₁(2/κ,1/κ;1+2/κ;|x|^κ); +∞ for |x| > 1.

    h(±1) is finite for κ > 1 (the barrier acts through h' → ∞). On [0, ½] the rule runs in s = c·u
    (smooth). On [½, |x|] the integrand has the (1−s)^{−1/κ} singularity at s = 1; the substitution
    1 − s = v^p with p = 2κ/(κ−1) turns it into a smooth v·g(v^p), and 1 − s^κ =
    −expm1(κ·log1p(−v^p)) is formed without cancellation.
    """
    k = float(kappa)
    a = x.abs().to(torch.float64)
    if k == 1.0:
        out = _z_minus_log1p(-a.clamp(max=1))
    elif k == 2.0:
        # ε(1 − √(1−x²)) = εx²/(1 + √(1−x²)), and 1 − x² = (1−|x|)(1+|x|): no cancellation anywhere.
        ac = a.clamp(max=1)
        out = ac * ac / (1 + torch.sqrt((1 - ac) * (1 + ac)))
    else:
        out = _chunked(lambda part: _power_barrier_h_quad(part, k), a)
    out = eps * out
    out = torch.where(a > 1, torch.full_like(out, math.inf), out)
    if k == 1.0:
        out = torch.where(a >= 1, torch.full_like(out, math.inf), out)
    return out.to(x.dtype)


def _power_barrier_h_quad(a: torch.Tensor, k: float) -> torch.Tensor:
    """∫₀^{min(a,1)} s(1−s^κ)^{−1/κ} ds for a ≥ 0, float64 (the quadrature of :func:`_power_barrier_h`)."""
    ac = a.clamp(max=1)
    c = ac.clamp(max=_SPLIT)

    def near(u):  # ∫₀^c s(1−s^κ)^{−1/κ} ds = c²∫₀¹ u(1−(cu)^κ)^{−1/κ} du
        cu = c.unsqueeze(-1) * u
        return u * (-torch.expm1(k * torch.log(cu.clamp(min=1e-300)))).pow(-1 / k)

    zero = torch.zeros_like(c)
    out = c * c * _integrate(near, zero, torch.ones_like(c))
    p = 2 * k / (k - 1)

    def far(v):  # s = 1 − v^p, ds = −p v^{p−1} dv
        vp = v.pow(p)
        s = 1 - vp
        one_minus_sk = -torch.expm1(k * torch.log1p(-vp))
        return s * p * torch.exp((p - 1) * torch.log(v) - torch.log(one_minus_sk) / k)

    v_hi = torch.full_like(c, _SPLIT).pow(1 / p)
    v_lo = (1 - ac).pow(1 / p)  # 1 − |x| is exact for |x| ≥ ½ (Sterbenz)
    tail = torch.where(ac > _SPLIT, _integrate(far, torch.minimum(v_lo, v_hi), v_hi), zero)
    return out + tail


def _power_barrier_conj(y: torch.Tensor, kappa: float, eps: float) -> torch.Tensor:
    """h*(y) = ∫₀^{|y|} s(ε^κ+s^κ)^{−1/κ} ds = ε·H(|y|/ε), H(z) = ∫₀^z t(1+t^κ)^{−1/κ} dt.

    z ≤ 1: H(z) = z²∫₀¹ u(1+(zu)^κ)^{−1/κ} du (smooth, no cancellation at small z).
    z > 1: H(z) = H(1) + (z−1) − ∫₁^z r(t) dt with r(t) = 1 − (1+t^{−κ})^{−1/κ}
    = −expm1(−log1p(t^{−κ})/κ) ≈ t^{−κ}/κ; substituting t = q^{−m}, m = max(1, 2/(κ−1)), makes
    the remainder integrand smooth on q ∈ [z^{−1/m}, 1], so |y| up to 1e8·ε and beyond stay exact.
    """
    k = float(kappa)
    a = y.abs().to(torch.float64)
    z = a / eps
    if k == 1.0:  # the log barrier's h* (where |y|/ε overflows, |y| to its rounding: LogBarrier.conj)
        return torch.where(torch.isinf(z), a, eps * _z_minus_log1p(z)).to(y.dtype)
    if k == 2.0:
        # √(ε²+y²) − ε = y²/(√(ε²+y²) + ε)
        out = a * a / (torch.hypot(a, torch.full_like(a, eps)) + eps)
        return out.to(y.dtype)

    return (eps * _chunked(lambda part: _power_barrier_conj_quad(part, k), z)).to(y.dtype)


def _power_barrier_conj_quad(z: torch.Tensor, k: float) -> torch.Tensor:
    """H(z) = ∫₀^z t(1+t^κ)^{−1/κ} dt for z ≥ 0, float64 (the quadrature of :func:`_power_barrier_conj`)."""

    def small(u, zz):
        zu = zz.unsqueeze(-1) * u
        return u * torch.exp(-torch.log1p(torch.exp(k * torch.log(zu.clamp(min=1e-300)))) / k)

    zc = z.clamp(max=1)
    zero = torch.zeros_like(zc)
    one = torch.ones_like(zc)
    h_small = zc * zc * _integrate(lambda u: small(u, zc), zero, one)
    one1 = torch.ones(1, dtype=torch.float64, device=z.device)
    h_one = _integrate(lambda u: small(u, one1), torch.zeros_like(one1), one1)
    m = max(1.0, 2 / (k - 1))

    def rem(q):  # ∫₁^z r(t) dt, t = q^{−m}, dt = −m q^{−m−1} dq
        log_tk = k * m * torch.log(q)  # log t^{−κ} = κ·m·log q
        r = -torch.expm1(-torch.log1p(torch.exp(log_tk)) / k)
        return r * m * torch.exp((-m - 1) * torch.log(q))

    zl = z.clamp(min=1)
    q_lo = zl.pow(-1 / m)
    big = h_one + (zl - 1) - _integrate(rem, q_lo, torch.ones_like(q_lo))
    return torch.where(z > 1, big, h_small)
