"""The working dtype of the spectral approximations, and the warning for slow bf16.

:func:`compute_dtype`: float64 for gram_eigh, bf16 matmuls on CUDA for the polynomial iterations,
at least float32 otherwise. :func:`slow_bf16` and :class:`BF16Warning`: bf16 iterations asked for
on a CPU that only emulates bf16 matmuls.
"""

from __future__ import annotations

import functools

import torch

from geomopt.geometry.matrix import working_dtype
from geomopt.spec.geometries import POLYNOMIAL_APPROX_KINDS, Approx, GramNewtonSchulz, NewtonSchulz, PolarExpress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

# the approximations that are matrix polynomial iterations (realize their own map, run in bf16 on
# CUDA, pre-normalize by default), as opposed to the exact factorizations svd and gram_eigh
POLYNOMIAL_APPROXES = POLYNOMIAL_APPROX_KINDS


def compute_dtype(x: torch.Tensor, kind: str, dtype: str = "auto") -> torch.dtype:
    """Working dtype of an approximation. ``auto``: float64 for gram_eigh (the Gram matrix squares
    the condition number, so fp32 would lose √u·σ_max ≈ 3e-4·σ_max); bf16 matmuls on CUDA for
    newton_schulz / polar_express (their polynomials are insensitive to it, as in Muon); otherwise
    at least float32. Factorizations (svd, eigh) have no bf16 kernels: bf16 requests run in fp32."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
        out = _DTYPES[dtype]
        if kind in ("svd", "gram_eigh") and out == torch.bfloat16:
            out = torch.float32
        return out
    if kind == "gram_eigh":
        return torch.float64
    if kind in POLYNOMIAL_APPROXES and x.is_cuda:
        return torch.bfloat16
    return working_dtype(x.dtype)


class BF16Warning(UserWarning):
    """bf16 matrix iterations requested where bf16 matmuls are slow (a CPU without native bf16)."""


@functools.lru_cache(maxsize=None)
def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16, AMX, or what oneDNN
    counts as bf16-capable); without it a bf16 matmul is emulated: on an AVX2-only CPU it ran at
    1.2 GFLOP/s against 119 GFLOP/s in fp32 (benchmarks/dtype.py). Unknown counts as native."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
                    or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def slow_bf16(approx: Approx | None, device) -> bool:
    """A polynomial iteration asked to run in bf16 on a CPU without native bf16 matmuls."""
    return (isinstance(approx, (NewtonSchulz, GramNewtonSchulz, PolarExpress)) and approx.dtype == "bfloat16"
            and torch.device(device).type == "cpu" and not native_bf16_cpu())
