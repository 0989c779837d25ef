"""Compensated low-precision weights: a bfloat16 parameter and what its rounding lost, kept as
optimizer state, decoded to the float32 weight a step works on and encoded again after it
(a rule's ``state: {compensation: int8|int16}``; :mod:`geomopt.optim.engine.masters` runs it).

Without it a bf16 weight w loses every update smaller than half its spacing
ulp(w) = 2^(e−8) (w = m·2^e, ½ ≤ |m| < 1: bf16 keeps 8 significant bits), and a long run at a small
lr stops moving (Zamirai et al. 2020, arXiv:2010.06192; the modded-nanogpt records keep the
float32 weight's low half beside a bf16 copy for this reason). Two forms:

* ``int16`` (:func:`split16`, :func:`join16`): the float32 weight x rounded to the nearest bf16 w
  (the parameter) and the rest of x's bit pattern, x − w counted in x's last bits, an int16 (the
  state). join16(split16(x)) = x bit for bit: the step sees exactly the float32 weight a float32
  master copy would hold, in the same 4 bytes, and the forward reads x rounded (not truncated,
  which would shrink every weight toward 0 by up to a spacing).
* ``int8`` (:func:`split8`, :func:`join8`): w = bf16(x), round to nearest, and the error x − w in
  units of ulp(w)/256, q = round((x − w)·2^(16−e)) ∈ [−127, 127] (|x − w| ≤ ulp/2 is 128 units at
  most; the one tie value is clamped). join8 reads x̂ = w + q·2^(e−16): |x̂ − x| ≤ ulp(w)/512
  (ulp/256 at the clamped tie), about 16 significant bits in 3 bytes, in bf16's normal range (below
  2^−126 the subnormals' spacing bounds it). FlashOptim (arXiv 2602.23349) keeps such an error term
  per weight. join8 then split8 gives back (w, q) exactly: w + q·2^(e−16) has at most 16
  significant bits, so it is exact in float32, and it rounds to w (|q| ≤ 127 < 128).
"""

from __future__ import annotations

import torch

from geomopt.optim.units.declare import WEIGHT, StateKey, declare

#: the weight's lost low bits; carried across a spec change with the parameter's rule
COMPENSATION_STATE = declare("compensation", StateKey("weight_error", layout=WEIGHT))
KEY = "weight_error"
#: compensation → the dtype of its state entry
DTYPES = {"int8": torch.int8, "int16": torch.int16}
#: parameter dtypes a compensation applies to
LOW = (torch.bfloat16,)
LOW_NAMES = tuple(str(t).removeprefix("torch.") for t in LOW)  # as a plan names dtypes


def compensated(pp, dtype) -> bool:
    """Whether a tensor of ``dtype`` (a torch dtype, or a plan's name of one) under plan ``pp``
    steps as a float32 weight stored as bf16 + error."""
    return pp.compensation != "none" and str(dtype).removeprefix("torch.") in LOW_NAMES


def step_dtype(pp, dtype: torch.dtype) -> torch.dtype:
    """The dtype a step sees a tensor of ``dtype`` in: float32 where it is compensated, its own
    otherwise."""
    return torch.float32 if compensated(pp, dtype) else dtype


def split16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` → (w: x rounded to bf16, half-way magnitudes up, as bf16; x's bit pattern minus
    w's, an int16). On the magnitude's bits: w = ⌊(|x| + 2^15) / 2^16⌋·2^16 (a carry into the
    exponent is bf16's rounding up to the next binade), so the remainder lies in [−2^15, 2^15).
    A NaN keeps bf16's NaN and a remainder of 0 (its payload is not kept)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    wmag = torch.where(nan, 0x7FC00000, (mag + 0x8000) & ~0xFFFF)
    low = torch.where(nan, 0, mag - wmag)
    return ((sign | wmag) >> 16).to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join16(w: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight: ``w``'s magnitude bits, shifted to float32's place, plus ``low``."""
    wb = w.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    mag = ((wb & 0x7FFF) << 16) + low.to(torch.int64)
    return (((wb & 0x8000) << 16) | mag).to(torch.int32).view(torch.float32)


def _units(w: torch.Tensor) -> torch.Tensor:
    """e − 16 for w = m·2^e (½ ≤ |m| < 1): the exponent of ulp(w)/256 (0 → e = 0)."""
    return torch.frexp(w.float()).exponent - 16


def split8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` → (w = bf16(x), q = round((x − w)/(ulp(w)/256)) as int8, clamped to ±127)."""
    w = x.to(torch.bfloat16)
    q = torch.ldexp(x - w.float(), -_units(w)).round_().clamp_(-127, 127).to(torch.int8)
    return w, q


def join8(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """w + q·ulp(w)/256 in float32 (as w − (−q)·ulp/256, so that −0 with q = 0 stays −0)."""
    return w.float() - torch.ldexp(torch.neg(q).float(), _units(w))


SPLIT = {"int8": split8, "int16": split16}
JOIN = {"int8": join8, "int16": join16}
