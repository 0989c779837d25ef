#!/usr/bin/env python
"""Mutation testing of the arithmetic of geomopt's math units: change one operator or constant at
a time and record which changes the tests notice.

    python scripts/mutate.py --workers 1 --out benchmarks/results/mutation.json
    python scripts/mutate.py --modules geometry/gap.py --list     # the mutants, without running
    python scripts/mutate.py --modules geometry/kron_psgd.py --per-module benchmarks/results/mutation_modules.json
                                                                # one module in full, its outcome kept per module

Sites: the functions (module level, and the methods of module-level classes) of
``geomopt/geometry/**/*.py``, ``geomopt/optim/units/stages.py``, ``geomopt/optim/units/directions.py`` and
``geomopt/optim/units/compensation.py`` (the compensated bf16 weights' split and join).
Operators (:data:`OPERATORS`): a numeric constant c → c+1, 2c, 0, and 1−c where 0 < c < 1 is a
float; a unary minus removed, or added to a returned value or to an arithmetic right-hand side;
``+``↔``-``, ``*``↔``/``, ``**``→``*`` (augmented assignments too); ``<``↔``<=``, ``>``↔``>=``;
``min``↔``max`` (builtins, tensor methods, ``clamp``'s keywords); a keyword argument ``k=1 - x``
→ ``k=x`` and ``alpha=x`` → ``alpha=1 - x``. Not mutated: docstrings, annotations, defaults,
decorators, ``raise`` and ``assert`` statements, warnings and logging, strings, and code outside
a function (module constants, module-level lambdas).

Speed: the parent imports torch, geomopt and the test modules once. Each mutant runs in a
fork()ed child that recompiles only the mutated function and swaps its ``__code__`` on the live
function object (every ``from x import f`` reference and every registry entry sees it), then runs
``pytest.main([...tests..., "-x", "-q", "-p", "no:cacheprovider"])`` under a timeout (a timeout
counts as killed, listed apart). The tests a mutant runs are those of :data:`TESTS` (a module's own
tests and the step's integration tests) that execute the mutated function: all of those of the
module's own test files (:data:`OWN_TESTS`), at most :data:`TESTS_PER_FILE` of each other file
spread over its cases; which tests execute which function is a map from test to the functions it
calls, computed once by profiling those tests and cached in ``.cache/`` (per test file, keyed by
the sources' and tests' contents).

A surviving mutant is either killed by a new test or explained in :data:`EXPLAINED` (why it is
equivalent, or why no test can tell it apart); the outcome file lists every survivor with its note.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import random
import signal
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
DEFAULT_MODULES = ("geomopt/geometry", "geomopt/optim/units/stages.py", "geomopt/optim/units/directions.py",
                   "geomopt/optim/units/compensation.py")
#: the groups the outcome file scores apart (path prefixes)
GROUPS = {"geometry": "geomopt/geometry/", "stages": "geomopt/optim/units/stages.py",
          "directions": "geomopt/optim/units/directions.py", "compensation": "geomopt/optim/units/compensation.py"}

#: the step's integration tests: every unit runs inside them
STEP_TESTS = ("tests/test_optimizer.py", "tests/test_equivalence.py", "tests/test_stages_variants.py")
#: source path (or folder) → the test files whose tests may kill its mutants: its own unit tests,
#: and the step's; the longest matching prefix wins
_GEOMETRY_TESTS = ("tests/test_forward.py", "tests/test_reference.py", "tests/test_gap.py",
                   "tests/test_spectral_approx.py", "tests/test_gram_newton_schulz.py",
                   "tests/test_backward.py", "tests/test_backward_floor.py", "tests/test_retractions.py",
                   "tests/test_method_auto.py", "tests/test_odd_tensors.py", "tests/test_adam_step.py",
                   "tests/test_dtype.py", "tests/test_kron.py", "tests/test_aol.py",
                   "tests/test_prox_polar.py", "tests/test_prox_scalar.py", "tests/test_prox_spectral_map.py",
                   "tests/test_mutation_kills.py", *STEP_TESTS)
#: the learned Kronecker metrics' (kron, kron_root, kron_psgd, learned) own tests: the arithmetic's
#: (test_kron), the ``kronecker`` geometry's as a spec (test_kronecker_geometry), its bf16 factors'
#: (test_kron_factors)
_KRON_MODULES = tuple(f"geomopt/geometry/{m}.py" for m in ("kron", "kron_root", "kron_psgd", "learned"))
_KRON_TESTS = ("tests/test_kron.py", "tests/test_kronecker_geometry.py", "tests/test_kron_factors.py")
TESTS: dict[str, tuple[str, ...]] = {
    "geomopt/geometry": _GEOMETRY_TESTS,
    **{m: (*_GEOMETRY_TESTS, *_KRON_TESTS[1:]) for m in _KRON_MODULES},
    "geomopt/geometry/polynomial.py": (*_GEOMETRY_TESTS, "tests/test_polynomial.py"),
    "geomopt/optim/units/stages.py": ("tests/test_stages.py", "tests/test_trust_ratio.py", "tests/test_stage_rows.py",
                                      "tests/test_stage_mutants.py", "tests/test_mutation_kills.py", *STEP_TESTS),
    "geomopt/optim/units/directions.py": ("tests/test_units.py", "tests/test_dion.py", "tests/test_adam_step.py",
                                          *STEP_TESTS),
    "geomopt/optim/units/compensation.py": ("tests/test_compensation.py", "tests/test_mutation_kills.py"),
}
#: the test files that run in full for a mutant of a module, not capped at :data:`TESTS_PER_FILE`: the
#: module's own unit tests (``tests/test_<module>.py``, or those named here) and the survivors' file
OWN_TESTS: dict[str, tuple[str, ...]] = {"geomopt/optim/units/directions.py": ("tests/test_units.py",
                                                                             "tests/test_dion.py"),
                                         "geomopt/optim/units/stages.py": ("tests/test_stages.py",
                                                                           "tests/test_trust_ratio.py",
                                                                           "tests/test_stage_rows.py",
                                                                           "tests/test_stage_mutants.py"),
                                         **{f"geomopt/geometry/prox/{m}.py": (f"tests/test_prox_{m}.py",)
                                            for m in ("polar", "scalar", "spectral_map")},
                                         **{m: _KRON_TESTS for m in _KRON_MODULES}}
ALWAYS_FULL = ("tests/test_mutation_kills.py",)
#: tests no mutant runs: torch.compile in a forked child costs seconds per mutant and starts
#: compile workers (the eager tests cover the same functions); test_compensation's two that start 4
#: gloo processes (its one-process tests cover the same split and join)
EXCLUDE = "not test_compiled_ and not test_ddp_steps_compensated and not test_sharded_parameters_are_refused"

_ITERATION_CAP = ("a safety cap on a host-side loop that converges in far fewer steps: never reached, so the "
                  "result is the same")
_ONE_MORE_STEP = ("the loop stops when |1 − x| ≤ ε instead of < ε: the two differ only where |1 − x| is exactly ε, "
                  "and then by one more step of a converged iteration")
_COST_MODEL = ("a flop estimate choosing between two methods that compute the same polar factor (to the dtype's "
               "precision): a changed estimate picks the other method, not another result")
_START_VECTOR = ("the power iteration's start vector: any vector with a component along the top singular vector "
                 "converges to the same estimate, which only bounds σ from above before the exact iteration")
_NEWTON_STEPS = ("more Newton steps of an iteration that has converged to the dtype's precision after the ones "
                 "given: the same result within rounding")
_TOP_TERM = ("the series' z²⁴ coefficient: for |z| < 0.1 that term is below 1e-22 of the leading z²/2, under "
             "float64's ε")
_SUBSTITUTION = ("the exponent of a change of variables in a quadrature: every positive value gives the same "
                 "integral, and the tests' tolerances hold with either")
_ROWS = ("dim 1 for dim −1 of the module's (B, n) rows of magnitudes (its docstring): the same dim")
_GROUPING = ("which form computes M·V·Diag(w)·Vᵀ, and over how many leading directions (those past the "
             "width have w = c and add nothing): a cost choice, the same product to rounding")
_POWER_SCALE = ("a power iterate (the start vector v, or w = Dv per row block) scaled by another positive or a "
                "negative number instead of its norm's reciprocal: only its direction is read, as v = Dᵀw and the "
                "estimate's w = Dv are normalized next")
_ONE_BLOCK = ("a matrix of one row block: only the length of the list of block sizes is read, and the per-block path "
              "(index_add over one block) sums the same entries, the same statistic to rounding")
_GAP_ROUNDING = ("how many ulps past 1 an entry of W may lie and still count as the boundary's rounding (the gap's "
                 "docstring: beyond rounding it is +∞): a tolerance, not a value the gap computes")
_FLOAT32_FLOOR = ("a lower default floor for float32 (2⁻²¹ or 2⁻⁴⁰ for 2⁻²⁰): more steps of a converging iteration, "
                  "the same polar factor")
_SERIES_CLAMP = ("the clamp that keeps the series' argument small where the direct formula is taken instead: the "
                 "values it changes are discarded")
_STACK_NORMS = ("unsqueeze(1) for unsqueeze(−1) of the (N,) norms of the (N, m, n) stack, or unsqueeze(1) or "
                "unsqueeze(−2) of the (N, 1) ones: the same (N, 1, 1)")
_SUMS_DIM = "max over dim 1 for dim −1 of the (b, k) column or row sums: the same dim"
_AT_LEAST_ONE_BLOCK = ("the fallback of ``len(view.blocks or [0]) or 1``: the length is at least 1 (a view without "
                       "blocks counts one), so the fallback is never taken")
_DIAGONAL_SUM = "sum over dim 1 for dim −1 of the (B, k) diagonals of the Gram matrices (tr A per matrix): the same dim"
_SQUARE_GRAM = "the identity's size from dim 1 or −2 for dim −1 of the (B, k, k) Gram matrices: the same k"
_OVERFLOWED_SQUARE = ("C₀'s ±∞ made 1 instead of 0: C₀ holds ±∞ only where A² overflowed while tr A did not (‖D‖_F "
                      "past about max^(1/4), 4e9 in float32: A² is formed before the pre-normalization), where C₀ is not "
                      "the map's factor whatever its ±∞ entries become; the deferred barrier sees tr A out of range there and "
                      "steps that bucket again without this factor (fused.in_range)")
_GRAM_NEVER_INFINITE = ("A·f² is never ±∞: |A_ij| ≤ tr A, so where tr A is finite A·f² ≤ A/‖D‖²_F ≤ 1 (f ≤ 1/‖D‖_F), and "
                        "where it is not f = 0 (∞·0 is NaN)")
#: survivors judged equivalent or unkillable, keyed ``path::function: original -> mutated`` (``#n``: the n-th
#: of the same change in that function): :attr:`Mutant.stable_key`, which lines added above it leave alone
EXPLAINED: dict[str, str] = {
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: a @ torch.take_along_dim(a, j.view(-1, 1, 1), dim=-2).mT "
    "-> -(a @ torch.take_along_dim(a, j.view(-1, 1, 1), dim=-2).mT)":
        "−x₁: only its norm is read (the bound is ‖Âᵀ·x̂₁‖)",
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: torch.take_along_dim(a, i.view(-1, 1, 1), dim=-1).mT @ a "
    "-> -(torch.take_along_dim(a, i.view(-1, 1, 1), dim=-1).mT @ a)":
        "−x₀: only its norm is read (the bound is ‖x̂₀·Âᵀ‖)",
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: x / torch.linalg.vector_norm(x, dim=(-2, -1), "
    "keepdim=True).clamp_min(tiny) -> -(x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(tiny))":
        "−x̂ for the unit x̂: only the norm of its product with Â or Âᵀ is read",
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: a / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs)) "
    "-> -(a / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs)))":
        "−Â for Â: the squares pick the same column and row, and each bound is the norm of a product of three Â's "
        "(x₀ = Â[:, i]ᵀ·Â, then ·Âᵀ), so the sign cancels in x̂ or the norm: the same bound",
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: -1 -> 1 #2": _SUMS_DIM,
    "geomopt/geometry/kron_psgd.py::norm_lower_bound: -1 -> 1 #4": _SUMS_DIM,
    "geomopt/geometry/kron.py::soap_refresh: -1 -> 1 #2":
        "argsort over dim 1 for dim −1 of the (b, k) eigenvalue estimates: the same dim",
    "geomopt/geometry/learned.py::soap: beta=beta -> beta=1 - beta":
        "β·L on the first step, whose factors init_factors has just made 0 (ε = 0): L = w·G·Gᵀ whatever β",
    "geomopt/geometry/learned.py::_view_matrices: 0 -> 1":
        "[1] for [0] as the blocks of a view without blocks: only the list's length is read",
    "geomopt/geometry/learned.py::_view_matrices: 1 -> 2": _AT_LEAST_ONE_BLOCK,
    "geomopt/geometry/learned.py::_view_matrices: 1 -> 0": _AT_LEAST_ONE_BLOCK,
    "geomopt/geometry/kron_psgd.py::_solve_right: x / q.unsqueeze(-2) -> -(x / q.unsqueeze(-2))":
        "−X·q⁻¹ for a diagonal factor's solve: B = Q_L⁻ᵀ·V·Q_R⁻¹ changes sign, and the fit reads it only as B·Bᵀ, "
        "Bᵀ·B or the sums of B∘B: the same terms",
    "geomopt/geometry/kron_psgd.py::fit: -1 -> 1 #3": "dim 1 for −1 of a diagonal factor's (b, k) terms: the same dim",
    "geomopt/geometry/adam.py::adam_multi_tensor: 0 -> 1":
        "xs[1] for xs[0]: every tensor of a bucket is on the same device",
    "geomopt/geometry/prox/polar.py::polar_steps: abs(1 - x) > eps -> abs(1 - x) >= eps": _ONE_MORE_STEP,
    "geomopt/geometry/prox/polar.py::polar_steps: 200 -> 201": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::polar_steps: 200 -> 400": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::polar_steps: n < 200 -> n <= 200": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: abs(1 - y * z) > eps -> abs(1 - y * z) >= eps":
        _ONE_MORE_STEP,
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: n < 100 -> n <= 100": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: 100 -> 101": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: 100 -> 200": _ITERATION_CAP,
    "geomopt/geometry/prox/polar.py::_gershgorin: -1 -> 1":
        "column sums for row sums of G, which is symmetric (the bound's contract): the same sums",
    "geomopt/geometry/prox/polar.py::_gershgorin: -1 -> 1 #2": "dim 1 for dim −1 of the (N, k) row sums: the same dim",
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: torch.arange(n, dtype=e.dtype, device=e.device) / (n + 1) * 0.7 -> torch.arange(n, dtype=e.dtype, device=e.device) / (n + 1) / 0.7":
        _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: 0.7 -> 1.7": _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: 0.7 -> 1.4": _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: 0.7 -> 0.30000000000000004": _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_polar_by_cost: 2 -> 3 #3": _COST_MODEL,
    "geomopt/geometry/prox/polar.py::_polar_by_cost: 2 -> 4 #3": _COST_MODEL,
    "geomopt/geometry/prox/polar.py::_polar_by_cost: m * n * n -> m * n / n": _COST_MODEL,
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: 1.5 - 0.5 * z * y -> -(1.5 - 0.5 * z * y)":
        "the host's simulation reads only y·z, which the step multiplies by t²: a negated t changes nothing "
        "it reads",
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: 1 -> 2":
        "at least two steps instead of one where both ends of the spectrum are already within ε of 1: one "
        "more step of a converged iteration",
    "geomopt/geometry/prox/polar.py::polar: 2.0 -> 4.0":
        "a lower default floor (2⁻⁸⁰ for 2⁻⁴⁰): more steps of a converging iteration, the same polar factor",
    "geomopt/geometry/prox/polar.py::_stiefel_polar: math.sqrt(r * r + math.sqrt(q) * (2 * r * t1 + t1 * t1)) <= 1.5 * (r + t) -> math.sqrt(r * r + math.sqrt(q) * (2 * r * t1 + t1 * t1)) < 1.5 * (r + t)":
        "the guard's two sides are equal only on a measure-zero set of (r, t, q); both branches' bounds hold "
        "there",
    "geomopt/geometry/prox/scalar.py::_unit_dual: 1 <= j <= 6 -> 1 < j <= 6":
        "κ = 2 through the general powers instead of squarings: the same values to rounding",
    "geomopt/geometry/prox/scalar.py::_unit_dual: 1 <= j <= 6 -> 1 <= j < 6":
        "κ = 64 through the general powers instead of squarings: the same values to rounding",
    "geomopt/geometry/prox/scalar.py::_unit_dual: 2 -> 4":
        "u capped at max^(1/κ)/4 instead of /2: past either cap (h₁*)' = 1 and (h₁*)'' = 0 to the working "
        "precision",
    "geomopt/optim/units/stages.py::_power_normalized: v / ctx.sum(v * v, cols).sqrt_().clamp_(min=eps) -> -(v / ctx.sum(v * v, cols).sqrt_().clamp_(min=eps))":
        "v negated: the estimate σ₁ ≈ ‖Dv‖ reads w = Dv only through w·w",
    "geomopt/optim/units/stages.py::_power_normalized: 1 -> 2": _POWER_SCALE,
    "geomopt/optim/units/stages.py::_power_normalized: 1 -> 2 #2": _POWER_SCALE,
    "geomopt/optim/units/stages.py::_power_normalized: w / to_rows(per_column(w * w).sqrt_().clamp_(min=eps)) -> -(w / to_rows(per_column(w * w).sqrt_().clamp_(min=eps)))":
        _POWER_SCALE,
    "geomopt/optim/units/stages.py::_per_axis: 1 -> 2": _ONE_BLOCK,
    "geomopt/optim/units/stages.py::_per_axis: 1 -> 0": _ONE_BLOCK,
    "geomopt/optim/units/stages.py::_per_axis: 1 -> 0 #2": _ONE_BLOCK,
    "geomopt/optim/units/directions.py::dion_rank: 1 -> 0 #2":
        "max(0, ·) for max(1, ·) of ⌈r·min(m, n)⌉, which is at least 1 for the fraction r > 0 the spec admits",
    "geomopt/geometry/gap.py::_h: a > 1 + 8 * eps -> a >= 1 + 8 * eps": _GAP_ROUNDING,
    "geomopt/geometry/gap.py::_h: 8 -> 9": _GAP_ROUNDING,
    "geomopt/geometry/gap.py::_h: 8 -> 16": _GAP_ROUNDING,
    "geomopt/geometry/gap.py::dual_norm: -1 -> 1 #2":
        "dim 1 for dim −1 of the (N, k) singular values of the (N, m, n) stack: the same dim",
    "geomopt/geometry/operators.py::unsupported_message: 1 -> 2":
        "difflib's two closest names instead of one: only the first, the same, is read",
    "geomopt/geometry/prox/polar.py::polar: -1 -> 1 #3": _STACK_NORMS,
    "geomopt/geometry/prox/polar.py::polar: -1 -> 1 #4": _STACK_NORMS,
    "geomopt/geometry/prox/polar.py::polar: 1 -> 2 #4": _STACK_NORMS,
    "geomopt/geometry/prox/polar.py::polar: 20 -> 21": _FLOAT32_FLOOR,
    "geomopt/geometry/prox/polar.py::polar: 20 -> 40": _FLOAT32_FLOOR,
    "geomopt/geometry/prox/polar.py::polar_steps: 0 -> 1":
        "at least one step counted where both ends of the interval are already within ε of 1 (two in all): one "
        "more step of a converged iteration",
    "geomopt/geometry/reference.py::_z_minus_log1p: 0.1 -> 0.2 #2": _SERIES_CLAMP,
    "geomopt/geometry/reference.py::_z_minus_log1p: 0.1 -> 1.1 #2": _SERIES_CLAMP,
    "geomopt/geometry/reference.py::_z_minus_log1p: 0.1 -> 0.9 #2": _SERIES_CLAMP,
    "geomopt/geometry/reference.py::_z_minus_log1p: 24 -> 25": _TOP_TERM,
    "geomopt/geometry/reference.py::_z_minus_log1p: 24 -> 48": _TOP_TERM,
    "geomopt/geometry/reference.py::_z_minus_log1p: 23 -> 24":
        "one more term z²⁵/24 of the series: for |z| < 0.1 below 1e-24 of the leading z²/2, under float64's ε",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: -1 -> 1": "unsqueeze(1) for unsqueeze(−1) of the (B,) flags: the same",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: -1 -> 1 #2": _ROWS,
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: -1 -> 1 #3":
        "unsqueeze(1) for unsqueeze(−1) of the (B,) slacks: the same",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: a.amax(-1) -> a.amin(-1)":
        "the scale of the rounding slack of the outward feasibility test: a tolerance, not a value the step computes",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: row_norm(a) >= r -> row_norm(a) > r":
        "a row exactly on the sphere taken outward instead of inward: both keep it, to the solve's rounding (|s| ≥ |a| with Σs² = r² is s = a)",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: (a + t + slack).square().sum(-1) < r * r -> (a + t + slack).square().sum(-1) <= r * r":
        "the outward infeasibility test at equality, which the rounding slack already widens: a tolerance's boundary",
    "geomopt/geometry/reference.py::_z_minus_log1p: 1 -> 2": _TOP_TERM,
    "geomopt/geometry/reference.py::_z_minus_log1p: 1 -> 0": _TOP_TERM,
    "geomopt/geometry/reference.py::LogBarrier.h: 1 -> 2":
        "|x| clamped at 2 instead of 1 before h's formula: where |x| ≥ 1 the result is +∞ whatever the "
        "formula gives",
    "geomopt/geometry/reference.py::_power_barrier_h_quad: 2 -> 3": _SUBSTITUTION,
    "geomopt/geometry/reference.py::_power_barrier_conj_quad: 2 -> 4": _SUBSTITUTION,
    "geomopt/geometry/prox/scalar.py::_interpolate: -1 -> 1": _ROWS,
    "geomopt/geometry/prox/scalar.py::_interpolate: -1 -> 1 #2": _ROWS,
    "geomopt/geometry/prox/scalar.py::_box_tau: -1 -> 1 #8": _ROWS,
    "geomopt/geometry/prox/scalar.py::_ball_finish: -1 -> 1 #3": _ROWS,
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: -1 -> 1 #4":
        "unsqueeze(1) for unsqueeze(−1) of the (B,) row norms: the same",
    "geomopt/geometry/prox/vector.py::_proj_linf_sphere: -1 -> 1 #4": _ROWS,
    "geomopt/geometry/prox/vector.py::_keep_top: -1 -> 1 #3": _ROWS,
    "geomopt/geometry/prox/spectral_map.py::_gram_compose: min(mats.shape[-2:]) -> max(mats.shape[-2:])": _GROUPING,
    "geomopt/geometry/prox/spectral_map.py::_gram_compose: 8 -> 16 #2": _GROUPING,
    "geomopt/geometry/prox/spectral_map.py::_gram_compose: 2 -> 0 #3": _GROUPING,
    "geomopt/geometry/prox/scalar.py::_newton_steps: 4 -> 5": _NEWTON_STEPS,
    "geomopt/geometry/prox/scalar.py::_newton_steps: 4 -> 8": _NEWTON_STEPS,
    "geomopt/geometry/prox/scalar.py::_newton_steps: 8 -> 9": _NEWTON_STEPS,
    "geomopt/geometry/prox/scalar.py::_newton_steps: 8 -> 16": _NEWTON_STEPS,
    "geomopt/geometry/prox/polar.py::scaled_polar_schedule: 1 - low > eps -> 1 - low >= eps": _ONE_MORE_STEP,
    "geomopt/geometry/reference.py::_power_barrier_conj_quad: 2 -> 3": _SUBSTITUTION,
    "geomopt/geometry/prox/scalar.py::_box_sigma: 1 -> 0":
        "the shrink α/τ for α/(1 + τ): another parametrization of the same σ, whose root τ' = 1 + τ the sphere's "
        "bisection on log τ finds as well (it lies in the bracket [2⁻⁶⁰, 2⁶⁰]), the same σ",
    "geomopt/optim/units/compensation.py::split16: 0x80000000 -> 2147483649":
        "the sign mask with bit 0 set: (sign | w) >> 16 shifts bit 0 out, the same w",
    "geomopt/geometry/prox/scalar.py::_solve_ball: -1 -> 1 #2": _ROWS,
    "geomopt/geometry/prox/polar.py::_polar_by_cost: 2 * m * n * n * len(scaled_polar_schedule(floor / top, "
    "mats.dtype)) - m * n * n -> 2 * m * n * n * len(scaled_polar_schedule(floor / top, mats.dtype)) + m * n * n":
        _COST_MODEL,
    "geomopt/geometry/reference.py::_z_minus_log1p: 1 / 24 -> 1 * 24": _TOP_TERM,
    "geomopt/geometry/prox/polar.py::_spectral_ball_polar: 2 * torch.finfo(a.dtype).eps * r -> "
    "2 * torch.finfo(a.dtype).eps / r":
        "the floor of S = sign(G − r²I) without its r² factor: it only sets how closely a σ within ~u·c/r of r is "
        "resolved, and there H's eigenvalue lies between r² and σ², moving the clipped σ by at most |σ − r| "
        "(the docstring's bound): no test's σ falls in that window (r = 0.02 checked too)",
    "geomopt/geometry/prox/polar.py::_spectral_ball_polar: r * r -> r / r #3":
        "the fallback of an empty batch (no matrix: the floor sets the steps of an iteration over nothing)",
    "geomopt/geometry/prox/scalar.py::_ball_finish: -1 -> 1 #2": _ROWS,
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: 4 * unit * s[:, :1] -> 4 * unit / s[:, :1]":
        "the tie test's threshold 4u/σ_max for 4u·σ_max: a rank cut through σ equal to the input's rounding still "
        "goes to the SVD, its λ being equal in the working dtype (R = ∞ from the slope over equal λ; checked at σ "
        "scaled by 1e±3): the route and the result are the same",
    "geomopt/geometry/prox/__init__.py::backward: 1.0 -> 0.0":
        "a constraint's radius scaled by its block's factor f also where f = 1: the same radius",
    "geomopt/geometry/matrix.py::matrices: 1 -> 0 #3":
        "max(0, ·) for max(1, ·) of the trailing size: they differ only for a zero-size tensor, which never steps",
    "geomopt/geometry/reference.py::_power_barrier_conj: 2.0 -> 0.0":
        "κ = 2 through the general quadrature instead of its closed form √(ε² + y²) − ε: the same h* to the "
        "quadrature's accuracy",
    "geomopt/geometry/reference.py::_power_barrier_conj_quad: 1.0 -> 2.0": _SUBSTITUTION,
    "geomopt/geometry/gap.py::_gap: -1 -> 1": "dim 1 for dim −1 of the (B, n) vectors: the same dim",
    "geomopt/geometry/gap.py::_gap: -1 -> 1 #3": "dim 1 for dim −1 of the (B, k) values of the k groups: the same dim",
    "geomopt/geometry/prox/scalar.py::_ball_newton: 0 -> 1":
        "h clamped at 1 instead of 0 in the upper bound s − min(h, 0): Newton on the concave H from the left lands "
        "at or below the root (the docstring), so h ≤ 0 but for rounding and the bound is the same",
    "geomopt/geometry/prox/polar.py::_polar_by_cost: mats.shape[-2] >= mats.shape[-1] -> "
    "mats.shape[-2] > mats.shape[-1]":
        "the Gram route's orientation for a square matrix, the only case where they differ: the cost model never "
        "takes that route for one (3n³ per inverse-square-root step against 2n³ per cubic step, no fewer steps; "
        "checked near Stiefel, t down to 1e-4·r)",
    "geomopt/geometry/kron_root.py::_well_conditioned: -1 -> 1":
        "shape[1] for shape[−1] of the (b, n, n) stack of square factors: the same n",
    "geomopt/geometry/kron_root.py::_well_conditioned: 1 -> 2": "shape[−2] for shape[−1] of square factors: the same n",
    "geomopt/geometry/kron_root.py::inverse_root_eigh: -1 -> 1 #2":
        "squeeze(1) for squeeze(−1) of nonzero()'s (k, 1) indices: the same (k,)",
    "geomopt/geometry/kron_root.py::inverse_root_newton: m - eye -> m + eye":
        "the first growth test against ‖M₀ + I‖_F ≥ ‖M₀ − I‖_F: more lenient, and the first iteration cannot grow "
        "‖M − I‖_F but by rounding (each eigenvalue moves no farther from 1; its docstring), which it does only where "
        "M₀ is I to rounding, B a multiple of I, whose X₀ = z^(1/p)·I is the root: one more step moves it by rounding",
    "geomopt/geometry/kron_root.py::inverse_root_newton: m_new - eye -> -(m_new - eye)":
        "M − I negated: only its Frobenius norm and largest |entry| are read, the same",
    "geomopt/geometry/kron_root.py::inverse_root_newton: dist_new <= max_error_ratio * dist -> "
    "dist_new < max_error_ratio * dist":
        "the growth test at equality: a boundary of measure zero but where both norms are 0, M_k = I exactly, so "
        "T_k = I and X_{k+1} = X_k: the same X",
    "geomopt/geometry/kron_root.py::inverse_root_newton: r_new.abs().amax(dim=(-2, -1)) > tol -> "
    "r_new.abs().amax(dim=(-2, -1)) >= tol": _ONE_MORE_STEP,
    "geomopt/geometry/view.py::apply: -1 -> 1 #7": "dim 1 for dim −1 of the (n_el, k) flags: the same dim",
    "geomopt/geometry/prox/polar.py::scaled_polar_schedule: 200 -> 201": _ITERATION_CAP,
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: 4 -> 8 #4":
        "x counted as lifted above 8u·max x instead of 4u: a lifted null direction's x is of the set's radius, far "
        "above either, and a kept σ below the Gram matrix's resolution below both: the same route",
    "geomopt/geometry/prox/vector.py::_proj_sign_set: r * sign_plus(v) -> r / sign_plus(v)":
        "r/s for r·s with s = ±1: the same",
    "geomopt/geometry/prox/scalar.py::_bisection_steps: 24 -> 25":
        "one more halving of a bracket the final interpolation already resolves to full precision (the comment's "
        "measurement: 8 halvings of margin)",
    "geomopt/geometry/gap.py::_gap: -1 -> 1 #8":
        "each batch element is one matrix here (a view's blocks are summed above): its values reshape to (B, 1) "
        "as to (B, −1)",
    "geomopt/geometry/prox/polar.py::_inverse_sqrt_steps: 1 -> 0":
        "one step instead of two where the whole spectrum is already within ε of 1: the first step, T = 1.5I − "
        "0.5H, is H^(−1/2) to O(ε²) there",
    "geomopt/geometry/prox/scalar.py::_solve_ball: rho2 > torch.finfo(alpha.dtype).max -> "
    "rho2 >= torch.finfo(alpha.dtype).max":
        "ρ² exactly the dtype's largest value taken as +∞: that ρ² is the projection's limit either way "
        "(t/r below 1e-19), the same magnitudes",
    "geomopt/geometry/reference.py::_power_barrier_conj_quad: z > 1 -> z >= 1":
        "at z = 1 both branches are H(1): h_one + (1 − 1) − ∫₁¹ = h_one = 1²·∫₀¹ of the small branch",
    "geomopt/geometry/reference.py::_gauss_legendre: k / torch.sqrt(4 * k * k - 1) -> "
    "-(k / torch.sqrt(4 * k * k - 1))":
        "the Jacobi matrix's off-diagonal negated: D·J·D with D = Diag(±1), the same eigenvalues (the nodes) and "
        "squared first components (the weights)",
    "geomopt/geometry/prox/scalar.py::_solve_ball: lo * hi -> lo / hi":
        "the safeguard's bisection point, taken only where a Newton step leaves its bracket beyond rounding: no "
        "solve of the tests (six references, t/r from 1e-3 to 5, float32 and float64) takes it",
    "geomopt/geometry/prox/spectral_map.py::_gram_compose: q * q + p * q -> q * q - p * q": _GROUPING,
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: x.amax(-1, keepdim=True) -> x.amin(-1, keepdim=True)":
        "the lifted test's threshold 4u·min x, at most 4u·max x: more matrices counted as lifting a null direction "
        "and sent to the float64 Gram or the SVD, routes at least as accurate: the same steps to rounding",
    "geomopt/geometry/prox/spectral_map.py::_gram_product: -1 -> 1 #2":
        "flip(1) for flip(−1) of the (B, q) w: the same",
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: 4 -> 5":
        "x = c·σ to 5u·max|x| instead of 4u: it only decides which directions count in the low-rank form's width, "
        "those between carrying w − c at rounding level: the same X to rounding",
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: -1 -> 1 #5": "dim 1 for dim −1 of the (B, q) w: the same dim",
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: 0 -> 1 #6":
        "the index of the smallest σ > 0 clamped at 1 instead of 0: they differ only for a matrix of rank ≤ 1, whose "
        "null directions have M·v = 0 whatever w they get, the one direction's w − c carrying its x: the same X",
    "geomopt/geometry/prox/spectral_map.py::spectral_apply: ratio <= _GRAM_TOLERANCE -> ratio < _GRAM_TOLERANCE #2":
        "R exactly at the tolerance 8 taken to the next route: a boundary of measure zero, both routes within the "
        "accuracy contract there",
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: 1 -> 0": _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_spectral_norm_estimate: 0.7 -> 0.0": _START_VECTOR,
    "geomopt/geometry/prox/polar.py::_stiefel_polar: 20 -> 40": _FLOAT32_FLOOR,
    "geomopt/geometry/scale.py::block_factors: 1.0 -> 2.0":
        "factors that are all 1 returned instead of None: every block scaled by 1, the same step",
    "geomopt/geometry/prox/scalar.py::sphere_magnitudes: a + t + slack -> a + t - slack":
        "the outward infeasibility test's rounding slack taken off instead of added: rows within 8u of the boundary "
        "flagged, a tolerance's side, not a value the step computes",
    "geomopt/geometry/view.py::resolve: 1 -> 2":
        "range(2, rows + 2) for range(2, rows + 1) in an error message's list of divisors: rows + 1 never "
        "divides rows, the same list",
    "geomopt/geometry/view.py::_restore: b + 2 -> b - 2":
        "the trailing-batch branch taken where the shape has no axes past the matrix (len ≤ b + 2): its extra "
        "axis is then of size 1, and the reshape and permute give the same tensor",
    "geomopt/geometry/kron.py::graft_to_norm: torch.linalg.matrix_norm(d3, keepdim=True) + tiny -> "
    "torch.linalg.matrix_norm(d3, keepdim=True) - tiny":
        "‖D‖_F − 1e-16 for ‖D‖_F + 1e-16: the same quotient to rounding for a nonzero D (‖D‖ ≫ 1e-16), 0 times "
        "it for a zero one",
    "geomopt/geometry/prox/spectral_map.py::_gram_eigh: -1 -> 1 #16":
        "dim 1 for dim −1 of the (B, q − 1) tie flags: the same dim",
    "geomopt/geometry/prox/groupwise.py::groupwise_frobenius_ball: a > 0 -> a >= 0":
        "a zero row's scale s/tiny: the ball step never grows a magnitude (s ≤ a = 0), so the same 0",
    "geomopt/geometry/prox/polar.py::_inverse_sqrt: 1 -> 2": "H is square: eye of shape[−2] is eye of shape[−1]",
    "geomopt/geometry/spectral.py::gram_eigh: 1 -> 0 #2":
        "the placeholder denominator where σ ≤ tol: the outer where discards that quotient (0 there)",
    "geomopt/geometry/spectral.py::gram_eigh: sigma > tol -> sigma >= tol #2":
        "the inner where's guard against dividing by σ at σ = tol: the outer where (σ > tol) discards that quotient",
    "geomopt/geometry/spectral.py::_pow2_scale: 1 -> 2 #2":
        "c = 2^(e−2) for 2^(e−1): still a power of two (an exact scaling, undone by σ = c·σ'), entries below 4 "
        "instead of 2: the Gram matrix neither overflows nor underflows either way, the same map to rounding",
    "geomopt/geometry/polynomial.py::first_factor_into: -1 -> 1 #2": _DIAGONAL_SUM,
    "geomopt/geometry/polynomial.py::first_factor_into: -1 -> 1 #3": _SQUARE_GRAM,
    "geomopt/geometry/polynomial.py::first_factor_into: 1 -> 2 #3": _SQUARE_GRAM,
    "geomopt/geometry/polynomial.py::first_factor_into: 0.0 -> 1.0 #2": _OVERFLOWED_SQUARE,
    "geomopt/geometry/polynomial.py::first_factor_into: 0.0 -> 1.0 #3": _OVERFLOWED_SQUARE,
    "geomopt/geometry/polynomial.py::_folded_iteration: -1 -> 1 #4": _DIAGONAL_SUM,
    "geomopt/geometry/polynomial.py::gram_quintic_iteration: -1 -> 1 #4": _DIAGONAL_SUM,
    "geomopt/geometry/polynomial.py::gram_quintic_iteration: 0.0 -> 1.0":
        "A·f²'s NaN (∞·0 where ‖D‖²_F overflowed, f = 0) made 1 instead of 0: the first R is multiplied by f = 0 and "
        "each later R is Q·R (a restart forms X = R·X = 0), so the result is 0 either way",
    "geomopt/geometry/polynomial.py::gram_quintic_iteration: 0.0 -> 1.0 #2": _GRAM_NEVER_INFINITE,
    "geomopt/geometry/polynomial.py::gram_quintic_iteration: 0.0 -> 1.0 #3": _GRAM_NEVER_INFINITE,
    "geomopt/geometry/polynomial.py::gram_quintic_iteration: i < steps -> i <= steps":
        "R copied from P at the last step too: the loop ends after it and P is not read again, the same R",
}

PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider")
#: the most tests of one file a mutant runs (a function the whole step calls is called by
#: hundreds): its cost on a shared 2-core machine
TESTS_PER_FILE = 12
#: a mutant's timeout: TIMEOUT_S + TIMEOUT_FACTOR × its tests' time when the map was made (under a
#: trace function, so already above their plain time)
TIMEOUT_S, TIMEOUT_FACTOR = 15.0, 3.0
#: exit codes of a mutant's child beyond pytest's own
CANNOT_APPLY = 97


# ---------------------------------------------------------------- mutants


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One change at one site: the ``variant``-th mutation of the ``site``-th mutable node (in
    :func:`_sites` order) of the function ``qualname`` of ``path``."""

    path: str
    module: str
    qualname: str
    site: int
    variant: int
    line: int
    col: int
    op: str
    original: str
    mutated: str
    nth: int = 0  # among the function's mutants of the same text (0: the first)

    @property
    def key(self) -> str:
        """Where it is: path:line:col, the original and the mutated text."""
        return f"{self.path}:{self.line}:{self.col}: {self.original} -> {self.mutated}"

    @property
    def stable_key(self) -> str:
        """What it is, whatever the lines above it: path::function, the original and the mutated text
        (and which of them, where the function has the same change more than once). :data:`EXPLAINED`
        is keyed by it, so an edit elsewhere in a file leaves the explanations in place."""
        return (f"{self.path}::{self.qualname}: {self.original} -> {self.mutated}"
                + (f" #{self.nth + 1}" if self.nth else ""))


_LOGGING = {"warn", "debug", "info", "warning", "error", "exception", "critical", "log"}
_NOT_ARITHMETIC = {"cast", "isinstance", "issubclass", "getattr", "hasattr", "setattr", "print", "repr", "str"}
_BINOP_SWAPS: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
                                  ast.Pow: ast.Mult}
_CMP_SWAPS: dict[type, type] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_MINMAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax",
           "amax": "amin", "clamp_min": "clamp_max", "clamp_max": "clamp_min", "clamp_min_": "clamp_max_",
           "clamp_max_": "clamp_min_"}
#: keyword arguments whose plain value is a coefficient worth flipping to 1 − value
_COEFFICIENT_KEYWORDS = {"alpha", "beta", "weight", "value"}
#: the operators, by name: what they change
OPERATORS = {
    "constant": "a numeric constant c → c+1, 2c, 0, 1−c (a float in (0, 1))",
    "unary_minus": "−x → x, or x → −x on a returned value or an arithmetic right-hand side",
    "binop": "+ ↔ −, × ↔ ÷, ** → ×",
    "compare": "< ↔ <=, > ↔ >=",
    "min_max": "min ↔ max (builtins, tensor methods and clamp's keywords)",
    "keyword": "k=1 − x → k=x, alpha/beta/weight/value=x → 1 − x",
}


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def _has_str(node: ast.AST) -> bool:
    """Whether a string takes part in the expression (concatenation, formatting: not arithmetic). A
    string that only names a value, a key (``cfg["beta2"]``) or an argument (``getattr(x, "n")``),
    takes no part: ``1 - cfg["beta2"]`` is arithmetic."""
    if _is_str(node):
        return True
    if isinstance(node, ast.Subscript):
        return _has_str(node.value) or (not _is_str(node.slice) and _has_str(node.slice))
    if isinstance(node, ast.Call):
        return any(_has_str(n) for n in (node.func, *node.args, *(k.value for k in node.keywords)) if not _is_str(n))
    return any(_has_str(n) for n in ast.iter_child_nodes(node))


def _number(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool))


def _skipped(node: ast.AST) -> bool:
    """Subtrees that are not arithmetic: error paths, checks, messages, logging."""
    if isinstance(node, (ast.Raise, ast.Assert, ast.JoinedStr, ast.Import, ast.ImportFrom, ast.Global,
                         ast.Nonlocal)):
        return True
    if isinstance(node, ast.Expr) and _is_str(node.value):
        return True  # a docstring
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in _LOGGING or name in _NOT_ARITHMETIC
    return False


def _children(node: ast.AST) -> Iterator[tuple[ast.AST, str, int | None, ast.AST]]:
    """(parent, field, index, child) of ``node``'s children a mutation may reach."""
    for field, value in ast.iter_fields(node):
        if field in ("decorator_list", "returns", "annotation", "type_comment", "type_params"):
            continue
        if field == "args" and isinstance(value, ast.arguments):
            continue  # annotations and defaults: evaluated where the function is defined
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST) and not _skipped(item):
                    yield node, field, i, item
        elif isinstance(value, ast.AST) and not _skipped(value):
            yield node, field, None, value


def _walk(node: ast.AST) -> Iterator[tuple[ast.AST, str, int | None, ast.AST]]:
    for parent, field, index, child in _children(node):
        yield parent, field, index, child
        yield from _walk(child)


Variant = tuple[str, ast.AST]  # (operator, the node that replaces the site)


def _with(node: ast.AST, **changes) -> ast.AST:
    new = copy.deepcopy(node)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _constant_variants(value: int | float) -> list:
    out: list = [value + 1]
    if value != 0:
        out += [value * 2, 0 if isinstance(value, int) else 0.0]
    if isinstance(value, float) and 0 < value < 1:
        out.append(1 - value)
    seen, unique = {value}, []
    for v in out:
        if v not in seen:
            seen.add(v)
            unique.append(v)
    return unique


def _variants(parent: ast.AST, field: str, node: ast.AST) -> list[Variant]:
    """Every mutation of ``node`` (at ``parent.field``)."""
    out: list[Variant] = []
    if _number(node):
        out += [("constant", ast.Constant(v)) for v in _constant_variants(node.value)]  # type: ignore[attr-defined]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and not _has_str(node):
        out.append(("unary_minus", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        if not _has_str(node) and not any(isinstance(s, (ast.Tuple, ast.List)) for s in (node.left, node.right)):
            out.append(("binop", _with(node, op=_BINOP_SWAPS[type(node.op)]())))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAPS and not _is_str(node.value):
        out.append(("binop", _with(node, op=_BINOP_SWAPS[type(node.op)]())))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP_SWAPS:
                ops = list(node.ops)
                ops[i] = _CMP_SWAPS[type(op)]()
                out.append(("compare", _with(node, ops=ops)))
    elif isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("min", "max"):
            out.append(("min_max", _with(node, func=ast.Name(_MINMAX[f.id], ast.Load()))))
        elif isinstance(f, ast.Attribute) and f.attr in _MINMAX:
            out.append(("min_max", _with(node, func=_with(f, attr=_MINMAX[f.attr]))))
        names = [k.arg for k in node.keywords]
        if "min" in names or "max" in names:
            keywords = [_with(k, arg=_MINMAX[k.arg]) if k.arg in ("min", "max") else copy.deepcopy(k)
                        for k in node.keywords]
            out.append(("min_max", _with(node, keywords=keywords)))
    elif isinstance(node, ast.keyword) and node.arg is not None:
        v = node.value
        if (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Sub) and _number(v.left)
                and v.left.value == 1):  # type: ignore[attr-defined]
            out.append(("keyword", _with(node, value=copy.deepcopy(v.right))))
        elif node.arg in _COEFFICIENT_KEYWORDS and isinstance(v, (ast.Name, ast.Attribute, ast.Subscript)):
            out.append(("keyword", _with(node, value=ast.BinOp(ast.Constant(1), ast.Sub(), copy.deepcopy(v)))))
    # a minus added where an arithmetic value leaves the function or is named
    if (field == "value" and isinstance(parent, (ast.Return, ast.Assign)) and isinstance(node, ast.BinOp)
            and not _has_str(node)):
        out.append(("unary_minus", ast.UnaryOp(ast.USub(), copy.deepcopy(node))))
    return out


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, def) of the module-level functions and of the methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _sites(fn: ast.AST) -> list[tuple[ast.AST, str, int | None, ast.AST, list[Variant]]]:
    out = []
    for parent, field, index, node in _walk(fn):
        variants = _variants(parent, field, node)
        if variants:
            out.append((parent, field, index, node, variants))
    return out


def mutants(path: Path, module: str, shown: str | None = None) -> list[Mutant]:
    """Every mutant of the source file ``path`` (importable as ``module``); ``shown``: the path
    the mutants name (default: ``path`` relative to the checkout)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    shown = shown or _relative(path)
    out = []
    for qualname, fn in _functions(tree):
        seen: dict = {}
        for k, (_, _, _, node, variants) in enumerate(_sites(fn)):
            original = " ".join((ast.get_source_segment(source, node) or ast.unparse(node)).split())
            for j, (op, new) in enumerate(variants):
                mutated = ast.unparse(new)
                nth = seen[(original, mutated)] = seen.get((original, mutated), -1) + 1
                out.append(Mutant(shown, module, qualname, k, j, node.lineno, node.col_offset, op, original,
                                  mutated, nth))
    return out


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- applying one


def live_function(module: str, qualname: str) -> types.FunctionType:
    """The function object ``module.qualname`` runs, under its decorators (functools wrappers,
    staticmethod, classmethod, property); an ``lru_cache`` on the way is cleared."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part)
    name = qualname.rsplit(".", 1)[-1]
    for _ in range(10):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, types.FunctionType) and obj.__code__.co_name == name:
            return obj
        elif hasattr(obj, "__wrapped__"):
            if hasattr(obj, "cache_clear"):
                obj.cache_clear()
            obj = obj.__wrapped__
        else:
            break
    raise LookupError(f"{module}.{qualname} is not a plain function under its decorators")


def _find_code(code: types.CodeType, qualnames: set[str]) -> types.CodeType | None:
    """The code object among ``code``'s constants (at any depth) with one of ``qualnames``."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_qualname in qualnames:
                return const
            found = _find_code(const, qualnames)
            if found is not None:
                return found
    return None


def mutated_code(mutant: Mutant, path: Path, live: types.FunctionType) -> types.CodeType:
    """The code object of ``mutant``'s function with the mutation applied, compiled with the same
    free variables as ``live`` (a closure's cells, ``__class__`` for a method calling super())."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    fn = dict(_functions(tree))[mutant.qualname]
    parent, field, index, _, variants = _sites(fn)[mutant.site]
    new = variants[mutant.variant][1]
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new
    fn.decorator_list = []
    scope = ast.parse("def _mutant_scope():\n    pass").body[0]
    assert isinstance(scope, ast.FunctionDef)
    cells = [v for v in live.__code__.co_freevars if v != "__class__"]
    body: list[ast.stmt] = [ast.Assign([ast.Name(v, ast.Store())], ast.Constant(None)) for v in cells]
    if "." not in mutant.qualname and fn.name not in cells:
        body.insert(0, ast.Global([fn.name]))  # a recursive call stays a global lookup, not a cell
    if "." in mutant.qualname:
        holder = ast.parse("class _Mutant:\n    pass").body[0]
        assert isinstance(holder, ast.ClassDef)
        holder.body = [fn]
        body.append(holder)
    else:
        body.append(fn)
    scope.body = body
    module = ast.Module(body=[scope], type_ignores=[])
    ast.fix_missing_locations(module)
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                 and any(a.name == "annotations" for a in n.names) for n in tree.body)
    import __future__
    flags = __future__.annotations.compiler_flag if future else 0
    method = "." in mutant.qualname
    qualnames = {f"_mutant_scope.<locals>._Mutant.{fn.name}"} if method else {fn.name}
    code = _find_code(compile(module, str(path), "exec", flags=flags, dont_inherit=True), qualnames)
    if code is None:
        raise LookupError(f"no code for {mutant.qualname} after compiling")
    if code.co_freevars != live.__code__.co_freevars:
        raise LookupError(f"{mutant.qualname}: free variables {code.co_freevars} != {live.__code__.co_freevars}")
    return code


def apply(mutant: Mutant, path: Path) -> None:
    """Swap the mutated code onto the live function (in this process only)."""
    live = live_function(mutant.module, mutant.qualname)
    live.__code__ = mutated_code(mutant, path, live)


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed, timed_out, survived, not_applied
    seconds: float
    tests: int
    note: str = ""


def _child(run: Callable[[], int]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 99
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(fd, "w")  # a test runner's capture may have replaced them
            code = run()
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    return pid


def run_mutants(items: Sequence[tuple[Mutant, Path, list[str], float]], *, workers: int = 1,
                pytest_args: Sequence[str] = (), progress: Callable[[Outcome, int, int], None] | None = None,
                stop_at: float | None = None) -> list[Outcome]:
    """Run each (mutant, its source file, its tests, its timeout) in a fork()ed child, at most
    ``workers`` at a time: the tests pass → survived; fail → killed; past the timeout → timed_out;
    the code could not be swapped → not_applied. Past ``stop_at`` (time.monotonic()) no mutant starts:
    the outcomes are those of the items run, in order (a prefix of ``items``)."""
    import gc

    import pytest

    # pytest's first run in a process loads its plugins and what they import lazily: done here once,
    # with the test modules imported, for every child
    files = sorted({t.split("::", 1)[0] for _, _, tests, _ in items for t in tests})
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        pytest.main([*files, "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args])
    gc.freeze()  # the children's collections skip (and do not copy) the parent's objects
    pending = list(enumerate(items))
    running: dict[int, tuple[int, float, float]] = {}  # pid → (item index, start, deadline)
    results: dict[int, Outcome] = {}

    def start(i: int) -> None:
        mutant, path, tests, timeout = items[i]

        def body() -> int:
            try:
                apply(mutant, path)
            except Exception:
                return CANNOT_APPLY
            return int(pytest.main([*tests, *PYTEST_ARGS, *pytest_args]))

        now = time.monotonic()
        running[_child(body)] = (i, now, now + timeout)

    def finish(i: int, status: str, seconds: float, note: str = "") -> None:
        mutant, _, tests, _ = items[i]
        results[i] = Outcome(mutant, status, round(seconds, 2), len(tests), note)
        if progress is not None:
            progress(results[i], len(results), len(items))

    while pending or running:
        if stop_at is not None and time.monotonic() > stop_at:
            pending.clear()
        while pending and len(running) < workers:
            start(pending.pop(0)[0])
        if not running:
            break
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, t0, deadline) in list(running.items()):
                if now > deadline:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    del running[p]
                    finish(i, "timed_out", now - t0)
            time.sleep(0.01)
            continue
        if pid not in running:
            continue
        i, t0, _ = running.pop(pid)
        seconds = time.monotonic() - t0
        if os.WIFSIGNALED(status):
            finish(i, "killed", seconds, f"the tests' process died of signal {os.WTERMSIG(status)}")
            continue
        rc = os.WEXITSTATUS(status)
        if rc == 0:
            finish(i, "survived", seconds)
        elif rc == CANNOT_APPLY:
            finish(i, "not_applied", seconds, "the mutated code could not be swapped in")
        elif rc in (1, 2):
            finish(i, "killed", seconds)
        else:
            finish(i, "error", seconds, f"pytest exited {rc}")
    return [results[i] for i in sorted(results)]


# ---------------------------------------------------------------- the project: tests per function


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def source_files(selection: Sequence[str]) -> list[str]:
    """The project's source files under the selected paths (``geometry/gap.py`` may omit
    ``geomopt/``)."""
    wanted = [s if s.startswith("geomopt") else f"geomopt/{s}" for s in selection]
    files = []
    for base in DEFAULT_MODULES:
        root = ROOT / base
        for p in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            rel = _relative(p)
            if any(rel == w or rel.startswith(w.rstrip("/") + "/") for w in wanted):
                files.append(rel)
    return files


def test_files(path: str) -> tuple[str, ...]:
    key = max((k for k in TESTS if path == k or path.startswith(k + "/")), key=len)
    return TESTS[key]


def _existing(paths: Sequence[str] | None = None) -> list[str]:
    """The test files of :data:`TESTS` that exist: those of the source files ``paths`` (default: every one)."""
    groups = [test_files(p) for p in paths] if paths is not None else list(TESTS.values())
    wanted = {t for files in groups for t in files}
    return sorted(t for t in wanted if (ROOT / t).exists())


def _digest(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(set(files)):
        h.update(name.encode())
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def _profile(files: Sequence[str]) -> dict:
    """Run the tests of ``files`` in a child with a global trace function: per file, {"tests": nodeid →
    seconds, "calls": "path::qualname" → nodeids that call the function (or a function defined
    inside it)}. A trace function is told of each Python frame's start only, where a profile function
    is called for every call and return, C ones included (the same map at about half the overhead:
    8 s against 12 s for test_spectral_approx, test_forward and test_stages)."""
    import pytest

    codes: dict[types.CodeType, str] = {}

    def nested(code: types.CodeType, key: str) -> None:
        codes[code] = key
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                nested(c, key)

    for path in source_files(DEFAULT_MODULES):
        for qualname, _ in _functions(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
            try:
                nested(live_function(module_name(path), qualname).__code__, f"{path}::{qualname}")
            except LookupError:
                pass

    class Recorder:
        def __init__(self):
            self.current: str | None = None
            self.found: dict[str, dict] = {f: {"tests": {}, "calls": {}} for f in files}

        def trace(self, frame, event, arg):
            """A global trace function: called on each Python frame's start only (no C calls, no
            returns), and no line events after it (it returns None)."""
            if self.current is not None:
                key = codes.get(frame.f_code)
                if key is not None:
                    self.found[self.current.split("::", 1)[0]]["calls"].setdefault(key, set()).add(self.current)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            self.current, t0 = item.nodeid, time.perf_counter()
            yield
            self.found[item.nodeid.split("::", 1)[0]]["tests"][item.nodeid] = round(time.perf_counter() - t0, 4)
            self.current = None

    CACHE.mkdir(exist_ok=True)
    out = Path(tempfile.mkstemp(dir=CACHE, suffix=".tmp")[1])

    def body() -> int:
        import threading

        rec = Recorder()
        sys.settrace(rec.trace)
        threading.settrace(rec.trace)
        rc = pytest.main([*files, "-q", "-p", "no:cacheprovider", "-k", EXCLUDE], plugins=[rec])
        sys.settrace(None)
        found = {f: {"tests": v["tests"], "calls": {k: sorted(ids) for k, ids in v["calls"].items()}}
                 for f, v in rec.found.items()}
        out.write_text(json.dumps({"files": found, "pytest_rc": int(rc)}), encoding="utf-8")
        return 0

    _, status = os.waitpid(_child(body), 0)
    data = json.loads(out.read_text(encoding="utf-8") or "{}")
    out.unlink(missing_ok=True)
    if not data or data.get("pytest_rc") != 0:
        raise SystemExit(f"the tests do not pass unmutated (pytest exited {data.get('pytest_rc', status)}): "
                         f"python -m pytest {' '.join(files)}")
    return data["files"]


def coverage_map(paths: Sequence[str] | None = None) -> dict:
    """{"tests": nodeid → seconds, "calls": "path::qualname" → nodeids that call it} over the test
    files of :data:`TESTS` of the source files ``paths`` (default: every one), from profiling the tests
    once; cached in .cache/mutate-map.json per test file (a file whose text changed is profiled again;
    every file, where a source or a test helper changed). Only the files a run's modules use are
    profiled: a run of one module does not wait on every other module's tests."""
    helpers = [_relative(p) for p in sorted((ROOT / "tests").glob("*.py")) if not p.name.startswith("test_")]
    sources = _digest([*source_files(DEFAULT_MODULES), *helpers])
    path = CACHE / "mutate-map.json"
    cached = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    per_file = cached.get("files", {}) if cached.get("sources") == sources else {}
    files = _existing(paths)
    now = {f: _digest([f]) for f in files}  # read before profiling: a file edited meanwhile is stale next time
    stale = [f for f in files if per_file.get(f, {}).get("digest") != now[f]]
    if stale:
        for f, found in _profile(stale).items():
            per_file[f] = {"digest": now[f], **found}
        CACHE.mkdir(exist_ok=True)
        path.write_text(json.dumps({"sources": sources, "files": per_file}), encoding="utf-8")
    tests: dict[str, float] = {}
    calls: dict[str, list[str]] = {}
    for f in files:
        tests.update(per_file[f]["tests"])
        for key, ids in per_file[f]["calls"].items():
            calls.setdefault(key, []).extend(ids)
    return {"tests": tests, "calls": calls}


def own_tests(path: str) -> set[str]:
    """The test files that run in full for a mutant of ``path`` (:data:`OWN_TESTS`, ``tests/test_<module>.py``,
    :data:`ALWAYS_FULL`)."""
    return {*OWN_TESTS.get(path, ()), f"tests/test_{Path(path).stem}.py", *ALWAYS_FULL}


def tests_for(mutant: Mutant, cmap: dict) -> list[str]:
    """The tests of the mutant's module's test files that call its function: all of those of its own
    test files (:func:`own_tests`), of the others at most :data:`TESTS_PER_FILE` per file, spread evenly
    over the file's calling tests in nodeid order (its parametrizations, its cases); then run fastest
    first."""
    calling = cmap["calls"].get(f"{mutant.path}::{mutant.qualname}", [])
    chosen = []
    own = own_tests(mutant.path)
    for f in test_files(mutant.path):
        ids = [t for t in calling if t.split("::", 1)[0] == f]
        if len(ids) > TESTS_PER_FILE and f not in own:
            ids = [ids[round(i * (len(ids) - 1) / (TESTS_PER_FILE - 1))] for i in range(TESTS_PER_FILE)]
        chosen += ids
    return sorted(chosen, key=lambda t: cmap["tests"].get(t, 0.0))


def _score(counts: dict) -> float | None:
    done = counts["killed"] + counts["timed_out"] + counts["survived"]
    return round((counts["killed"] + counts["timed_out"]) / done, 4) if done else None


def summarize(outcomes: Sequence[Outcome]) -> dict:
    """Per module and per group: mutants, killed, timed out, survived (and how many of those are
    explained), not applied; the score (killed + timed out) / (killed + timed out + survived) and
    the same without the explained survivors."""

    def tally(rows: list[Outcome]) -> dict:
        c = {"mutants": len(rows), **{s: sum(o.status == s for o in rows)
                                      for s in ("killed", "timed_out", "survived", "not_applied", "error")}}
        c["explained"] = sum(o.status == "survived" and o.mutant.stable_key in EXPLAINED for o in rows)
        c["score"] = _score(c)
        rest = dict(c, survived=c["survived"] - c["explained"])
        c["score_unexplained"] = _score(rest)
        return c

    by_path: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_path.setdefault(o.mutant.path, []).append(o)
    groups = {g: tally([o for o in outcomes if o.mutant.path.startswith(prefix)]) for g, prefix in GROUPS.items()}
    return {"groups": {g: c for g, c in groups.items() if c["mutants"]},
            "modules": {p: tally(rows) for p, rows in sorted(by_path.items())}}


RECORDED = ROOT / "benchmarks" / "results" / "mutation.json"
#: full runs of single modules (``--per-module``), one outcome record per module
PER_MODULE = ROOT / "benchmarks" / "results" / "mutation_modules.json"
#: the section of benchmarks/RESULTS.md that holds the recorded run's table
RESULTS_SECTION = "Mutation testing (`scripts/mutate.py`)"


def record_results(record: dict) -> None:
    """The recorded outcome's table and caption, as the docs render them (scripts/readme_tables.py's
    ``mutation``), put in :data:`RESULTS_SECTION` of benchmarks/RESULTS.md (``benchmarks/_results.record``)."""
    loaded = {}
    for name, path in (("readme_tables", ROOT / "scripts" / "readme_tables.py"),
                       ("_results", ROOT / "benchmarks" / "_results.py")):
        spec = importlib.util.spec_from_file_location(f"_mutate_{name}", path)
        assert spec is not None and spec.loader is not None
        loaded[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[name])
    text = loaded["readme_tables"].mutation(lambda key, path: record)
    machine = record.get("machine") or {}
    heading = (f"### Mutation score of the math units, {machine.get('cpu', 'CPU')}, torch {machine.get('torch', '?')} "
               f"— {record['date']}")
    loaded["_results"].record(RESULTS_SECTION, f"{heading}\n\n{text}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES),
                    help="source files or folders (default: geometry/, optim/units/stages.py, directions.py, "
                         "compensation.py)")
    ap.add_argument("--max-mutants", type=int, default=None, help="a seeded sample of at most this many mutants")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    ap.add_argument("--workers", type=int, choices=(1, 2), default=1, help="children at a time (default 1)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit without running them")
    ap.add_argument("--out", type=Path, default=None, help="write the outcome as JSON here")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="start no mutant after this many seconds; the mutants run in a seeded random order, so "
                         "those done are a uniform sample, and the outcome is theirs")
    ap.add_argument("--rerun-survivors", type=Path, default=None, metavar="OUTCOME",
                    help="run again the unexplained survivors of this outcome file (after tests were added) and "
                         "update it in place: their new outcomes, the counts, the explanations")
    ap.add_argument("--per-module", type=Path, default=None, metavar="OUTCOME",
                    help=f"also put each module's outcome in this file (one entry per module, replacing that "
                         f"module's last; the docs quote {_relative(PER_MODULE)}): every mutant of the modules, "
                         f"no --max-mutants or --stop-after")
    args = ap.parse_args(argv)
    if args.per_module is not None and (args.max_mutants is not None or args.stop_after is not None):
        ap.error("--per-module records a full run of each module: leave out --max-mutants and --stop-after")
    if args.rerun_survivors is not None:
        return rerun_survivors(args.rerun_survivors, workers=args.workers)
    paths = source_files(args.modules)
    if not paths:
        ap.error(f"no source file under {' '.join(args.modules)} (choose under {', '.join(DEFAULT_MODULES)})")
    every = [m for p in paths for m in mutants(ROOT / p, module_name(p), p)]
    chosen = every
    if args.max_mutants is not None and args.max_mutants < len(every):
        keep = sorted(random.Random(args.seed).sample(range(len(every)), args.max_mutants))
        chosen = [every[i] for i in keep]
    if args.stop_after is not None:
        chosen = list(chosen)
        random.Random(args.seed).shuffle(chosen)
    if args.list:
        for m in chosen:
            print(f"{m.path}:{m.line}:{m.col} [{m.op}] {m.qualname}: {m.original} -> {m.mutated}")
        print(f"{len(chosen)} of {len(every)} mutants in {len(paths)} files", file=sys.stderr)
        return 0

    load = os.getloadavg()  # the machine may be shared: how busy it was as the run began
    t0 = time.monotonic()
    items = _prepare(paths, chosen)
    stop_at = None if args.stop_after is None else t0 + args.stop_after
    runnable = [it for it in items if it[2]]
    outcomes = run_mutants(runnable, workers=args.workers, pytest_args=("-k", EXCLUDE), progress=_progress(t0),
                           stop_at=stop_at)
    if len(outcomes) < len(runnable):  # stopped: the mutants run (a prefix of the seeded order) are the sample
        ran = {id(o.mutant) for o in outcomes}
        last = max(i for i, it in enumerate(items) if id(it[0]) in ran)
        items = items[:last + 1]
    untested = [Outcome(it[0], "survived", 0.0, 0, "no test of its module's test files calls this function")
                for it in items if not it[2]]
    outcomes = sorted(outcomes + untested, key=lambda o: (o.mutant.path, o.mutant.line, o.mutant.col, o.mutant.variant))
    seconds = time.monotonic() - t0
    command = "python scripts/mutate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run = {"command": command, "load": [round(x, 2) for x in load], "workers": args.workers,
           "seconds": round(seconds, 1), "seed": args.seed, "stopped_after": args.stop_after}
    record = outcome_record(outcomes, len(every), **run)
    print(f"{len(outcomes)} mutants in {seconds:.0f} s")
    _write(record, args.out)
    if args.per_module is not None:
        for p in paths:
            mine = [o for o in outcomes if o.mutant.path == p]
            entry = outcome_record(mine, sum(m.path == p for m in every),
                                   **dict(run, seconds=round(sum(o.seconds for o in mine), 1)))
            record_per_module(p, entry, args.per_module)
    return 0


def outcome_record(outcomes: Sequence[Outcome], of: int, *, command: str, load: Sequence[float], workers: int,
                   seconds: float, seed: int, stopped_after: float | None) -> dict:
    """The outcome file's record of a run: how it ran (``command``, the machine's ``load`` as it began,
    ``workers``, ``seconds``), the sample (``outcomes`` of ``of`` mutants, ``seed``, ``stopped_after``),
    the counts (:func:`summarize`) and every survivor, timeout and mutant not applied."""
    from geomopt.cli.demo import machine, source_version

    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "source": source_version(ROOT), "machine": machine("cpu"),
        "load": list(load), "workers": workers, "seconds": seconds,
        "operators": OPERATORS, "tests_per_file": TESTS_PER_FILE, "own_tests_in_full": True,
        "sample": {"mutants": len(outcomes), "of": of, "seed": seed, "sampled": len(outcomes) < of,
                   **({"stopped_after": stopped_after} if stopped_after is not None else {})},
        **summarize(outcomes),
        "survivors": [{"at": f"{o.mutant.path}:{o.mutant.line}:{o.mutant.col}", "key": o.mutant.stable_key,
                       "function": o.mutant.qualname,
                       "op": o.mutant.op, "original": o.mutant.original, "mutated": o.mutant.mutated,
                       "tests": o.tests, **({"note": o.note} if o.note else {}),
                       **({"explained": EXPLAINED[o.mutant.stable_key]} if o.mutant.stable_key in EXPLAINED else {})}
                      for o in outcomes if o.status == "survived"],
        "timed_out": [{"at": f"{o.mutant.path}:{o.mutant.line}:{o.mutant.col}", "original": o.mutant.original,
                       "mutated": o.mutant.mutated, "seconds": o.seconds} for o in outcomes
                      if o.status == "timed_out"],
        "not_applied": [{"at": o.mutant.key, "note": o.note} for o in outcomes if o.status in ("not_applied", "error")],
    }


def record_per_module(path: str, entry: dict, out: Path) -> None:
    """Put ``entry``, the outcome record of a full run of the module ``path`` (its ``seconds``: its mutants'),
    in the per-module outcome file ``out`` (``{"modules": {path: record}}``), replacing the module's last."""
    data = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {"modules": {}}
    data["modules"][path] = entry
    data["modules"] = dict(sorted(data["modules"].items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{path}: recorded in {_relative(out)}")


def _prepare(paths: Sequence[str], chosen: Sequence[Mutant]) -> list[tuple[Mutant, Path, list[str], float]]:
    """In this process: torch on one thread, the sources imported, the map of tests to functions; then
    each mutant with its source file, its tests (:func:`tests_for`) and its timeout."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(ROOT)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch

    torch.set_num_threads(1)
    for p in paths:
        importlib.import_module(module_name(p))
    cmap = coverage_map(paths)
    items = []
    for m in chosen:
        tests = tests_for(m, cmap)
        budget = sum(cmap["tests"].get(t, 0.0) for t in tests)
        items.append((m, ROOT / m.path, tests, TIMEOUT_S + TIMEOUT_FACTOR * budget))
    return items


def _progress(t0: float) -> Callable[[Outcome, int, int], None]:
    def progress(o: Outcome, done: int, total: int) -> None:
        if o.status != "killed" or done % 50 == 0:
            print(f"[{done}/{total} {time.monotonic() - t0:.0f}s] {o.status}: {o.mutant.key}", flush=True)
    return progress


def _write(record: dict, out: Path | None) -> None:
    for g, c in record["groups"].items():
        print(f"{g}: {c['killed']} killed, {c['timed_out']} timed out, {c['survived']} survived "
              f"({c['explained']} explained) of {c['mutants']}: score {c['score']}, "
              f"explained left out {c['score_unexplained']}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        if out.resolve() == RECORDED.resolve():
            record_results(record)


def _recount(c: dict, killed: int, explained: int) -> dict:
    """A tally of :func:`summarize` with ``killed`` survivors now killed and ``explained`` of the
    remaining ones explained."""
    c = dict(c, killed=c["killed"] + killed, survived=c["survived"] - killed, explained=explained)
    c["score"] = _score(c)
    c["score_unexplained"] = _score(dict(c, survived=c["survived"] - explained))
    return c


def rerun_survivors(path: Path, *, workers: int = 1) -> int:
    """Run the unexplained survivors of the outcome file ``path`` (a run's, or the per-module file's
    records) again, with the tests as they are now, and update the file: a survivor the tests now kill
    counts as killed (tests only added: the killed mutants stay killed), the explanations are read again
    from :data:`EXPLAINED`, and each record lists the rerun (its date, source, mutants and how many it
    killed)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    records = [data] if "survivors" in data else list(data["modules"].values())
    wanted = {s["key"] for r in records for s in r["survivors"] if s["key"] not in EXPLAINED}
    files = sorted({s["at"].split(":", 1)[0] for r in records for s in r["survivors"] if s["key"] in wanted})
    current = {m.stable_key: m for p in files for m in mutants(ROOT / p, module_name(p), p)}
    missing = sorted(wanted - set(current))
    if missing:
        raise SystemExit(f"survivors no longer among the mutants (the code changed; run the sample again): {missing}")
    t0 = time.monotonic()
    items = [it for it in _prepare(files, [current[k] for k in sorted(wanted)]) if it[2]]
    outcomes = run_mutants(items, workers=workers, pytest_args=("-k", EXCLUDE), progress=_progress(t0))
    from geomopt.cli.demo import source_version  # importable once _prepare has put the checkout on the path

    caught = {o.mutant.stable_key for o in outcomes if o.status in ("killed", "timed_out")}
    seconds = {o.mutant.stable_key: o.seconds for o in outcomes}
    for record in records:
        mine = {s["key"] for s in record["survivors"] if s["key"] in seconds}
        _recount_record(record, caught)
        if not mine and records[0] is not data:
            continue  # a module none of whose survivors ran: its record lists no rerun
        record.setdefault("reruns", []).append({
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "source": source_version(ROOT),
            "mutants": len(mine), "killed": len(mine & caught),
            "seconds": round(sum(seconds[k] for k in mine), 1) if records[0] is not data else
            round(time.monotonic() - t0, 1)})
    if records[0] is data:
        _write(data, path)
    else:
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        for p, r in data["modules"].items():
            c = r["modules"].get(p, {})
            print(f"{p}: score {c.get('score')}, explained left out {c.get('score_unexplained')}")
    return 0


def _recount_record(record: dict, caught: set[str]) -> None:
    """``record``'s survivors that are in ``caught`` counted killed, its explanations read again."""
    survivors = [s for s in record["survivors"] if s["key"] not in caught]
    killed = {s["key"] for s in record["survivors"]} & caught
    for s in survivors:
        s.pop("explained", None)
        if s["key"] in EXPLAINED:
            s["explained"] = EXPLAINED[s["key"]]

    def counts(prefix: str, c: dict) -> dict:
        explained = sum(s["key"].startswith(prefix) and "explained" in s for s in survivors)
        return _recount(c, sum(k.startswith(prefix) for k in killed), explained)

    record["modules"] = {p: counts(p + "::", c) for p, c in record["modules"].items()}
    record["groups"] = {g: counts(GROUPS[g], c) for g, c in record["groups"].items()}
    record["survivors"] = survivors


if __name__ == "__main__":
    raise SystemExit(main())
