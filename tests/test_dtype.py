"""The Newton–Schulz dtype: shipped specs say ``auto`` (bf16 on CUDA, float32 on CPU); a spec
that asks for bf16 on a CPU that emulates bf16 matmuls gets one warning that says the cost."""

from __future__ import annotations

import platform
import warnings

import pytest
import torch

import geomopt
from geomopt.geometry import dtypes as spectral
from geomopt.geometry.dtypes import BF16Warning, compute_dtype
from optim_helpers import SHIPPED, SPECS, tiny_mlp


def _with_dtype(path, dtype: str) -> dict:
    spec = geomopt.load_spec(path).model_dump()
    for rule in spec["rules"]:
        approx = rule["geometry"].get("approx") or {}
        if approx.get("kind") in spectral.POLYNOMIAL_APPROXES:
            approx["dtype"] = dtype
    return spec


def test_shipped_specs_leave_the_dtype_to_the_device():
    for path in SHIPPED + sorted(SPECS.glob("*.geom")):
        for rule in geomopt.load_spec(path).rules:
            approx = getattr(rule.geometry, "approx", None)
            assert approx is None or approx.dtype == "auto", (path.name, rule.name)
    x = torch.randn(4, 3)
    assert compute_dtype(x, "newton_schulz") == torch.float32
    assert compute_dtype(x.to("meta"), "polar_express") == torch.float32


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_bf16_on_a_cpu_without_native_bf16_warns_once(native, monkeypatch):
    monkeypatch.setattr(spectral, "native_bf16_cpu", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geomopt.GeomOptimizer(tiny_mlp(0, depth=3), _with_dtype(SPECS / "muon.yaml", "bfloat16"))
        geomopt.GeomOptimizer(tiny_mlp(0, depth=3), SPECS / "muon.yaml")  # auto: never
    mine = [w for w in caught if issubclass(w.category, BF16Warning)]
    assert len(mine) == (0 if native else 1)
    if mine:
        text = str(mine[0].message)
        assert "'hidden'" in text and "'muon'" in text and "GFLOP/s" in text and "dtype to auto" in text
        assert mine[0].filename == __file__  # points at the caller's line


def test_the_detection_matches_what_torch_reports():
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        assert spectral.native_bf16_cpu() is False  # no AVX-512, so no AVX-512 BF16 nor AMX
    else:
        assert isinstance(spectral.native_bf16_cpu(), bool)
