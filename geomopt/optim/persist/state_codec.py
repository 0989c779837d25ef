"""Optimizer state in a lower precision between steps (a rule's ``state: {dtype: …}``): each batched
step decodes its bucket's state to float32, runs in float32 as always, and encodes the result back.

The formats (bfloat16, int8, int8-ec) and their random bits are
:mod:`geomopt.optim.persist.codes`; this module decides which entries are stored in which, and
encodes and decodes a bucket's state piece by piece.

A rule's moments (the keys declared ``moment``) take its ``dtype``; a learned metric's factors (the
keys declared ``factor``: Shampoo's, SOAP's and PSGD's L and R) take its ``factors`` instead
(float32, or bfloat16 by the same stochastic rounding), whatever the moments' precision; every other
entry stays float32.

Sharded tensors (:class:`Codec`'s ``start``, ``full`` and ``aligned``): every rank encodes its own
block, so a quantization block must lie within one shard: int8 (and ``int8-ec``) needs the last dim
cut at multiples of 256 (FSDP2's row cuts always are; a tensor cut elsewhere keeps float32 state, on
every rank alike), and its block scales (and corrections) are DTensors cut like the tensor. Then
every layout stores the same codes as one process.

A state entry records its own precision: float32, bfloat16, or uint8 codes beside a ``<key>_absmax``
entry (and, ``int8-ec``, a ``<key>_ec`` correction). Whatever the rule's precision, a step decodes
what it finds (a checkpoint saved under another precision, a migration) and writes the rule's.
"""

from __future__ import annotations

import torch

from geomopt.optim.persist.codes import (BLOCK, SCRATCH, block_scaled, decode_int8, decode_int8_ec, encode_bf16,
                                         encode_correction, fresh, nearest_codes, noise, pack4, seed_of, side_shape,
                                         unpack4)
from geomopt.optim.units.state_keys import CORRECTION, FACTORS, MOMENTS, SCALE, SIDE
from geomopt.spec.model import QUANTIZED

#: entries encoded or decoded at a time (a multiple of BLOCK): bounds a step's temporaries (int64
#: indices and codes) to a few MiB whatever the bucket's size
CHUNK = 1 << 18
#: a rule's ``state`` precision → the dtype its encoded entries are stored in
STORED = {"bfloat16": torch.bfloat16, "int8": torch.uint8, "int8-ec": torch.uint8}


def quantizable(t: torch.Tensor, key: str) -> bool:
    """Whether ``key``'s state of one tensor shaped like ``t`` (a bucket's row) is kept in int8."""
    return key in MOMENTS and t.numel() % BLOCK == 0 and t.numel() > 0


def aligned(shape: tuple, blocks: tuple) -> bool:
    """Whether a tensor of ``shape`` (the operators' layout) sharded into ``blocks`` (every rank's
    ((start, size) per dim)) has every int8 block within one shard: its last dim a multiple of 256,
    cut only at multiples of 256."""
    n = shape[-1] if shape else 0
    return n > 0 and n % BLOCK == 0 and all(b[-1][0] % BLOCK == 0 for b in blocks if all(m for _, m in b))


def decode_entry(state: dict) -> dict:
    """One tensor's saved state with its encoded entries as float32 (a checkpoint's, for a migration):
    :meth:`Codec.decode` on the entry as a stack of one."""
    one = {k: v.unsqueeze(0) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    out = Codec.decode(one)
    return dict(state) if out is one else {k: v[0] if isinstance(v, torch.Tensor) else v for k, v in out.items()}


class Codec:
    """A bucket's state in the rule's precision ``dtype``: :meth:`decode` whatever is stored,
    :meth:`encode` into ``dtype`` (nothing to do for float32). ``names``: its tensors', ``step``: the
    step count (with the state key they seed stochastic rounding). Sharded: ``start`` and ``full``,
    where this rank's block of each tensor lies in the whole (operators' layout), and ``aligned``:
    whether int8 blocks lie within shards on every rank (:func:`aligned`). ``factors``: the
    precision of a learned metric's factors (float32 or bfloat16), apart from the moments'."""

    def __init__(self, dtype: str, names: tuple = (), step: int = 0, start: tuple = (), full: tuple = (),
                 aligned: bool = True, factors: str = "float32"):
        self.dtype, self.names, self.step, self.factors = dtype, names, step, factors
        self.start, self.full, self.aligned = start, full, aligned

    def stored(self, key: str, row: torch.Tensor) -> bool:
        """Whether ``key`` is kept encoded for a tensor shaped like ``row``."""
        if key in FACTORS:
            return self.factors == "bfloat16"
        if self.dtype == "bfloat16":
            return key in MOMENTS
        if self.full:  # sharded: decided for the whole tensor, so every rank (even one holding none) alike
            return self.dtype in QUANTIZED and self.aligned and key in MOMENTS
        return self.dtype in QUANTIZED and quantizable(row, key)

    @staticmethod
    def decode(state: dict) -> dict:
        """float32 working copies of the encoded entries of a gathered (stacked) state; the same
        dict when nothing is encoded."""
        out = None
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dtype not in STORED.values():
                continue
            out = dict(state) if out is None else out
            if value.dtype == torch.bfloat16:
                out[key] = value.float()
            elif key + SCALE in state:
                flat = torch.empty(value.numel(), dtype=torch.float32, device=value.device)
                for a, b in _pieces(value.numel()):
                    decode_piece(state, key, a, b, flat[a:b])
                out[key] = flat.reshape(value.shape)
                del out[key + SCALE]
                out.pop(key + CORRECTION, None)
        return state if out is None else out

    def encode(self, values: dict) -> dict:
        """The stored form of float32 ``values`` (a bucket's stacked state after its step)."""
        if self.dtype == "float32" and self.factors == "float32":
            return values
        out = dict(values)
        for key, value in values.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not self.stored(key, value[0]):
                continue
            flat = value.reshape(-1)
            seeds = [seed_of(name, self.step, key) for name in self.names]
            stored = self.empty(key, flat.numel(), flat.device)
            for a, b in _pieces(flat.numel()):
                self.encode_piece(key, flat[a:b], a, b, tuple(value.shape), seeds, stored)
            out.update(shaped(stored, tuple(value.shape)))
        return out

    def bf16(self, key: str) -> bool:
        """Whether ``key`` is stored as bfloat16 (a moment under bf16 state, a factor under bf16 factors)."""
        return key in FACTORS or self.dtype == "bfloat16"

    def empty(self, key: str, numel: int, device) -> dict:
        """Flat uninitialized stored entries for ``numel`` values of the moment ``key`` (its codes or
        bf16 values; int8: a scale per 256; ``int8-ec``: a correction byte per two entries), what
        :meth:`encode_piece` writes."""
        if self.bf16(key):
            return {key: torch.empty(numel, dtype=torch.bfloat16, device=device)}
        out = {key: torch.empty(numel, dtype=torch.uint8, device=device),
               key + SCALE: torch.empty(numel // BLOCK, dtype=torch.float32, device=device)}
        if self.dtype == "int8-ec":
            out[key + CORRECTION] = torch.empty(numel // 2, dtype=torch.uint8, device=device)
        return out

    def encode_piece(self, key: str, x: torch.Tensor, a: int, b: int, shape: tuple, seeds: list,
                     out: dict, take=fresh) -> None:
        """Encode the float32 values ``x`` of the entries [a, b) (row-major) of a stack shaped ``shape``
        (rows seeded by ``seeds``: :func:`seed_of` of a tensor's name, the step and ``key``) into the
        flat stored entries ``out`` (:meth:`empty`) at the same place (:meth:`encode_values`). ``a`` and
        ``b`` are multiples of BLOCK where int8 (a row's size is too: a block lies within a row), so
        encoding a stack piece by piece gives the bits of encoding it whole: a block's scale reads its
        own entries only, and the rounding's random bits hash each entry's index in its tensor
        (:func:`noise`). ``take``: where the temporaries live (:func:`fresh`; with :meth:`reserve`'s
        slots taken, nothing allocates)."""
        bits = None
        if self.rounds(key):
            bits = noise(seeds, shape, self.start, self.full, a, b, x.device, take)
        self.encode_values(key, x, bits, piece_of(out, a, b), take)

    def rounds(self, key: str) -> bool:
        """Whether ``key``'s stored form is rounded stochastically (reads random bits): bf16 values,
        ``int8-ec`` corrections."""
        return self.bf16(key) or self.dtype == "int8-ec"

    def encode_values(self, key: str, x: torch.Tensor, bits, out: dict, take=fresh) -> None:
        """Encode the float32 values ``x`` (1-D; a multiple of BLOCK entries where int8) into ``out``, the
        stored entries of just these values (:func:`piece_of`), ``bits`` their random bits where the
        form :meth:`rounds` (:func:`noise`). The codec's arithmetic: :meth:`encode_piece` runs it
        eagerly, :mod:`geomopt.optim.engine.fused` compiled (with ``take`` :func:`fresh`)."""
        if self.bf16(key):
            encode_bf16(x, bits, take, out[key])
            return
        scaled, _ = block_scaled(x.unsqueeze(0), take, out[key + SCALE])
        c = nearest_codes(scaled, MOMENTS[key], take)  # encode_int8's codes
        out[key].copy_(c)
        if key + CORRECTION in out:
            pack4(encode_correction(scaled, c, MOMENTS[key], bits, take), out[key + CORRECTION], take)

    def encode_range(self, key: str, x: torch.Tensor, a: int, shape: tuple, out: dict) -> None:
        """:meth:`encode_piece` of the float32 values ``x`` (1-D) of the entries [a, a + len(x)) of a
        stack shaped ``shape`` (rows: this codec's tensors), a piece of at most CHUNK entries at a
        time (``a`` a multiple of BLOCK where int8), so its temporaries stay a chunk's."""
        seeds = [seed_of(name, self.step, key) for name in self.names]
        for s, e in _pieces(x.numel(), _range_piece()):
            self.encode_piece(key, x[s:e], a + s, a + e, shape, seeds, out)

    @staticmethod
    def reserve(take, n: int, device) -> None:
        """Every scratch slot of the codec (:data:`SCRATCH`) taken for pieces of up to ``n`` entries,
        so that encoding and decoding them through ``take`` then allocates nothing."""
        for slot, dtype in SCRATCH.items():
            take(slot, (2 * n if slot == "codec.f1" else n,), dtype, device)


def shaped(stored: dict, shape: tuple) -> dict:
    """:meth:`Codec.empty`'s flat entries of a stack shaped ``shape`` (rows: tensors) in their state
    shapes: the codes (or bf16 values) as the stack, the scales and corrections per row
    (:func:`scale_shape`)."""
    row = shape[1:]
    return {k: v.reshape(shape) if not k.endswith(SIDE) else v.reshape(shape[0], *side_shape(k, row))
            for k, v in stored.items()}


def piece_of(stored: dict, a: int, b: int) -> dict:
    """The flat stored entries ``stored`` (:meth:`Codec.empty`) of the values [a, b) alone: their
    codes or bf16 values, and their blocks' scales and corrections (``a``, ``b``: multiples of BLOCK
    where int8)."""
    per = {k: BLOCK if k.endswith(SCALE) else 2 if k.endswith(CORRECTION) else 1 for k in stored}
    return {k: v.reshape(-1)[a // per[k]: b // per[k]] for k, v in stored.items()}


def decode_piece(state: dict, key: str, a: int, b: int, out: torch.Tensor, take=fresh) -> None:
    """The float32 values of the entries [a, b) (row-major; multiples of BLOCK where int8) of the
    entry ``key`` of ``state`` (a stack or one tensor: int8 codes with their ``<key>_absmax`` scales
    and ``int8-ec`` correction, bf16 values, or float32 ones) into the 1-D ``out``. ``take``: where
    the temporaries live (:func:`fresh`)."""
    value = state[key].reshape(-1)
    if key + SCALE not in state:
        out.copy_(value[a:b])
        return
    c, m = value[a:b].unsqueeze(0), state[key + SCALE].reshape(-1)[a // BLOCK: b // BLOCK]
    fixes = state.get(key + CORRECTION)
    if fixes is None:
        decode_int8(c, m, MOMENTS[key], take, out)
    else:
        t = unpack4(fixes.reshape(-1)[a // 2: b // 2], take("codec.u0", (b - a,), torch.uint8, c.device))
        decode_int8_ec(c, t, m, MOMENTS[key], take, out)


def decode_range(state: dict, key: str, a: int, out: torch.Tensor) -> None:
    """:func:`decode_piece` of the entries [a, a + len(out)) of ``state``'s ``key`` into the 1-D
    ``out``, a piece of at most CHUNK entries at a time (``a`` a multiple of BLOCK where int8)."""
    for s, e in _pieces(out.numel(), _range_piece()):
        decode_piece(state, key, a + s, a + e, out[s:e])


def row_groups(rows: int, row: int) -> list:
    """[i, j) ranges of whole rows covering a stack of ``rows`` rows of ``row`` entries each, each of
    at most CHUNK entries (one row, where a row is larger): what a batched bucket decodes at a time."""
    k = max(1, CHUNK // max(row, 1))
    return [(i, min(rows, i + k)) for i in range(0, rows, k)]


def _range_piece() -> int:
    """The piece of :func:`decode_range` and :meth:`Codec.encode_range`: CHUNK/4 entries (a multiple
    of BLOCK), since a batched bucket runs them at its commit beside its update and look-ahead,
    where the pieces' temporaries (int64 indices, the rounding's bits: ~20 bytes per entry) count,
    ~1.3 MiB a piece. CHUNK/16 cost an encoded muon step 8–22% over decoding whole, this 1–5%."""
    return max(BLOCK, CHUNK // 4 // BLOCK * BLOCK)


def _pieces(total: int, size: int = 0):
    """[a, b) ranges of at most ``size`` entries (CHUNK where 0) covering ``total``."""
    size = size or CHUNK
    for a in range(0, total, size):
        yield a, min(total, a + size)
