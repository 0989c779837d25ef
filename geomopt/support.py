"""The operator support table: what the operators support, as plain data. No torch, so
``geomopt lint`` (and anything else that only reasons about a spec) reads it without loading the
math.

* The backward table (paper Table 1): every backward op of :mod:`geomopt.geometry.prox` by
  function name, with the geometries and constraints it serves. The op modules register each
  function under its row (:func:`geomopt.geometry.operators.backward_op`), so this table is the one
  place a (geometry, constraint) pair is declared; :func:`supported_constraints` and
  :func:`has_backward` answer from it.
* The spectral approximations' coefficient lists (Newton–Schulz, plain or Gram, and Polar
  Express) and the reference they realize (:func:`realized_reference`);
  :mod:`geomopt.geometry.spectral` runs them.
"""

from __future__ import annotations

import math
from typing import Sequence

from geomopt.spec.constraints import CONSTRAINT_KINDS

#: The geometries that read a tensor as one or more matrices (a rule's ``view`` says which), as
#: opposed to the elementwise ones: they need ndim ≥ 2 and take a body's matrices.
MATRIX_GEOMETRIES = ("spectral", "rowwise", "columnwise", "kronecker")

# ---------------------------------------------------------------- the backward table

SET_KINDS = tuple(k for k in CONSTRAINT_KINDS if k != "proximal_decay")
SPECTRAL_SETS = ("spectral_ball", "spectral_sphere", "stiefel", "rank")
# Sets whose prox is P_C(Y) for every separable (anisotropic) φ: h even and increasing in |u|, and
# the nearest point in ‖·‖∞ coincides with the Euclidean one.
SEPARABLE_SETS = ("sign_set", "linf_ball", "linf_sphere", "l0")

#: backward op (function name in geomopt.geometry.prox) → (geometries, constraints) it serves,
#: in registration order (the order :func:`supported_constraints` lists them in).
BACKWARD_TABLE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "euclidean_projection": (("euclidean", "isotropic"), SET_KINDS),
    "anisotropic_separable": (("anisotropic",), SEPARABLE_SETS),
    "anisotropic_l2_ball": (("anisotropic",), ("l2_ball", "frobenius_ball")),
    "anisotropic_sphere": (("anisotropic",), ("frobenius_sphere",)),
    "spectral_projection": (("spectral",), ("stiefel", "spectral_ball", "spectral_sphere", "rank")),
    "spectral_frobenius_ball": (("spectral",), ("frobenius_ball", "l2_ball")),
    "spectral_frobenius_sphere": (("spectral",), ("frobenius_sphere",)),
    "groupwise_frobenius_ball": (("rowwise", "columnwise"), ("frobenius_ball", "l2_ball")),
    "groupwise_frobenius_sphere": (("rowwise", "columnwise"), ("frobenius_sphere",)),
    "proximal_decay": (("euclidean", "isotropic", "anisotropic", "spectral", "rowwise", "columnwise"),
                       ("proximal_decay",)),
}


def backward_pairs(op: str) -> list[tuple[str, str]]:
    """The (geometry, constraint) pairs backward op ``op`` serves."""
    geometries, constraints = BACKWARD_TABLE[op]
    return [(g, c) for g in geometries for c in constraints]


#: (geometry, constraint) → backward op name, in registration order.
BACKWARD_PAIRS: dict[tuple[str, str], str] = {pair: op for op in BACKWARD_TABLE for pair in backward_pairs(op)}


def supported_constraints(geometry: str) -> list[str]:
    """Constraint kinds with a backward op for ``geometry``, in registration order."""
    return [c for (g, c) in BACKWARD_PAIRS if g == geometry]


def has_backward(geometry: str, constraint: str) -> bool:
    return (geometry, constraint) in BACKWARD_PAIRS


# ---------------------------------------------------------------- spectral approximations

Triple = tuple[float, float, float]

#: Muon's quintic (Keller Jordan, https://kellerjordan.github.io/posts/muon/; the default of
#: torch.optim.Muon, ``DEFAULT_A/B/C`` in torch/optim/_muon.py): maximizes the slope at 0 (a), so
#: σ does not converge to 1 but ends in roughly [0.68, 1.13] after 5 steps.
MUON_COEFFICIENTS: Triple = (3.4445, -4.7750, 2.0315)

#: Polar Express, degree 5, as printed in Algorithm 1 of Amsel, Persson, Musco, Gower, "The Polar
#: Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm" (2025,
#: arXiv:2505.16932; github.com/NoahAmsel/PolarExpress): the minimax-optimal odd quintics for
#: σ ∈ [1e-3, 1], before the safety factor. The last triple is the fixed point used for every
#: later step.
_POLAR_EXPRESS_RAW: tuple[Triple, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

#: The authors' list with their 1.01 safety factor applied as in Algorithm 1: (a/1.01, b/1.01³,
#: c/1.01⁵), i.e. p(x/1.01), on every triple but the last. (Their reference code also divides the
#: input by 1.01·‖X‖_F; here input scaling is the geometry's ``prenormalize`` field.)
POLAR_EXPRESS_COEFFICIENTS: tuple[Triple, ...] = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for (a, b, c) in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

#: The 5-step list of the modded-nanogpt speedrun (KellerJordan/modded-nanogpt, train_gpt.py,
#: ``polar_express_coeffs``; computed with the Polar Express recipe for 5 iterations, safety
#: factor 2e-2, cushion 2; the speedrun applies its safety as X/(1.02·‖X‖_F + 1e-6) instead of in
#: the coefficients).
SPEEDRUN_COEFFICIENTS: tuple[Triple, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

#: NVIDIA Emerging-Optimizers' named Newton–Schulz coefficient sets (muon_utils._COEFFICIENT_SETS of
#: github.com/NVIDIA-NeMo/Emerging-Optimizers, as the package ships them: 4 decimals), the
#: ``coefficients`` names of newton_schulz and gram_newton_schulz. ``aol`` is Turbo-Muon's (Boissin
#: et al. 2025, arXiv:2512.04632; github.com/thib-s/flash-newton-schulz): four steps fitted to start
#: from the AOL rescaling (geometry ``prenormalize: aol``). ``polar_express`` is the authors' list
#: with the 1.01 safety factor (:data:`POLAR_EXPRESS_COEFFICIENTS`) to 4 decimals (within 1e-4).
NEWTON_SCHULZ_SETS: dict[str, tuple[Triple, ...]] = {
    "simple": (MUON_COEFFICIENTS,),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
}

#: The named sets that repeat their last triple past their end (the package's ``repeat_last``); the
#: others start again from the first (``cycle``).
REPEAT_LAST_SETS = ("polar_express", "cans")

COEFFICIENT_LISTS: dict[str, tuple[Triple, ...]] = {
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
    "speedrun": SPEEDRUN_COEFFICIENTS,
}


def newton_schulz_coefficients(steps: int = 5,
                               coefficients: str | Sequence[Sequence[float]] | None = None) -> list[Triple]:
    """The per-step triples Newton–Schulz runs: Muon's triple (default) or one user triple reused
    ``steps`` times, or exactly ``steps`` user triples, or the first ``steps`` of a named set of
    :data:`NEWTON_SCHULZ_SETS`, cycled past its end or, for :data:`REPEAT_LAST_SETS`, its last
    triple repeated (as Emerging-Optimizers' ``get_coefficient_iterator`` does)."""
    if coefficients is None:
        return [MUON_COEFFICIENTS] * steps
    if isinstance(coefficients, str):
        if coefficients not in NEWTON_SCHULZ_SETS:
            raise ValueError(f"unknown coefficient set {coefficients!r}; "
                             f"expected one of {', '.join(NEWTON_SCHULZ_SETS)} or a list of triples")
        base = list(NEWTON_SCHULZ_SETS[coefficients])
        if coefficients in REPEAT_LAST_SETS:
            return base[:steps] + [base[-1]] * max(0, steps - len(base))
        return [base[i % len(base)] for i in range(steps)]
    triples = [_triple(t) for t in coefficients]
    if len(triples) == 1:
        return triples * steps
    if len(triples) != steps:
        raise ValueError(f"newton_schulz: coefficients must hold 1 or steps={steps} triples, got {len(triples)}")
    return triples


def polar_express_coefficients(steps: int = 5,
                               coefficients: str | Sequence[Sequence[float]] = "polar_express") -> list[Triple]:
    """The first ``steps`` triples of a named list (``polar_express``, ``speedrun``) or a user list;
    past its end the last triple repeats (for ``polar_express`` the last is the fixed point
    (15/8, −5/4, 3/8) of the quintic Newton–Schulz iteration, as the authors do)."""
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_LISTS:
            raise ValueError(f"unknown coefficient list {coefficients!r}; "
                             f"expected one of {sorted(COEFFICIENT_LISTS)} or a list of triples")
        base = list(COEFFICIENT_LISTS[coefficients])
    else:
        base = [_triple(t) for t in coefficients]
        if not base:
            raise ValueError("polar_express: coefficients must hold at least one triple")
    return base[:steps] + [base[-1]] * max(0, steps - len(base))


def _triple(t: Sequence[float]) -> Triple:
    if len(t) != 3:
        raise ValueError(f"a coefficient triple has 3 numbers (a, b, c), got {list(t)}")
    return (float(t[0]), float(t[1]), float(t[2]))


def approx_coefficients(approx: dict) -> list[Triple] | None:
    """The triples an ``approx`` dict runs (None for svd and gram_eigh)."""
    kind = approx.get("kind", "svd")
    if kind in ("newton_schulz", "gram_newton_schulz"):  # the same map, by another route
        return newton_schulz_coefficients(approx.get("steps", 5), approx.get("coefficients"))
    if kind == "polar_express":
        return polar_express_coefficients(approx.get("steps", 5), approx.get("coefficients", "polar_express"))
    return None



def realized_reference(approx: dict) -> dict | None:
    """The reference an approximation realizes: for newton_schulz (gram_newton_schulz: the same
    map) / polar_express the κ = 4 power barrier with ε = 1/∏aᵢ (the composed polynomial's slope
    at 0 is ∏aᵢ, and (h₄*)'(σ) = σ/(ε⁴+σ⁴)^{1/4} has slope 1/ε there; paper Appendix F,
    Theorem 4.7), on the pre-normalized input. None for svd and gram_eigh (they realize the
    declared reference)."""
    coeffs = approx_coefficients(approx)
    if coeffs is None:
        return None
    slope = math.prod(a for a, _, _ in coeffs)
    return {"kind": "power_barrier", "kappa": 4.0, "eps": 1.0 / slope}
