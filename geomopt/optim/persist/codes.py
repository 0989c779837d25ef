"""The stored formats of low-precision optimizer state, as arithmetic on tensors: bf16 with
stochastic rounding, block-wise int8 codes of the dynamic map, and int8-ec's 4-bit
corrections, with the random bits that round them. :mod:`geomopt.optim.persist.state_codec`
decides which state entries take which format and runs these on a bucket's state.

* ``bfloat16``: stochastic rounding, bf16(x) rounded away from zero with probability equal to the
  discarded fraction of x's float32 mantissa (the 16 low bits read as a fraction of 2¹⁶), so
  E[bf16(x)] = x and a momentum's small per-step changes are kept on average instead of lost to
  bf16's spacing (the rounding torchao's low-bit optimizers use for bf16 state).
* ``int8`` (moments only): block-wise dynamic quantization (Dettmers et al., 8-bit Optimizers via
  Block-wise Quantization, arXiv:2110.02861, §2.1–2.2): each tensor's entries in blocks of 256,
  each block divided by its largest magnitude, and each value stored as the nearest of 256 codes
  of the dynamic map (an exponent of 10 from 10⁻⁶ to 1 and a linear fraction, finer near zero:
  :func:`dynamic_map`): signed for first moments, unsigned (all codes ≥ 0) for second moments.
  The codes are the state entry (uint8, the tensor's shape) and the block scales a second entry
  (``<key>_absmax``), shaped like the tensor with its last dim in blocks (``(…, n/256)``) where n
  is a multiple of 256, else one per block of the flattened tensor. A tensor whose size is not a
  multiple of 256 keeps float32 state.
* ``int8-ec`` (moments only): int8 with error compensation. Each value x of a block of scale a lies
  in its code c's bin, the interval [E_c, E_{c+1}) between the midpoints around the code
  (:func:`bin_edges`); int8 keeps c and drops the residual x − a·map_c. ``int8-ec`` keeps that
  residual as 4 bits t per entry (``<key>_ec``, two to a byte), the position of x/a in its bin in
  16 steps, t = 15·(x/a − E_c)/(E_{c+1} − E_c) rounded stochastically to an integer (up with
  probability its fraction, as bf16's rounding), and decodes a·(E_c + t/15·(E_{c+1} − E_c))
  (:func:`encode_correction`, :func:`decode_int8_ec`). The residual's scale is the bin's width,
  known from the code: no scale of its own is stored. The correction is added back to the moment
  each step decodes, so it enters the next encode: what one encode rounds away is kept (to a 15th
  of the bin) instead of lost, and what is left is unbiased (E[decoded] = x), so a moment's small
  per-step changes are kept on average, where int8's nearest code stalls a moment whose change
  per step is below half its bin (its error then grows with the steps until it reaches that
  bound / (1 − β)). State bytes: 1.5 per entry plus a scale per 256, 0.38 of float32's (int8:
  0.25, bfloat16: 0.5).

The random bits of stochastic rounding are a hash (:func:`noise`) of each entry's index in the whole
tensor (in the operators' layout), the tensor's name, the state key and the step count: a run is
reproducible, a checkpoint resumes bit for bit with no generator state saved, the user's random
streams are untouched, and a sharded tensor rounds each entry exactly as one process does.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional, Sequence

import torch

from geomopt.optim.units.state_keys import CORRECTION

BLOCK = 256
#: the steps of an ``int8-ec`` correction within a code's bin (4 bits: 0 … 15)
STEPS = 15
_MAPS: dict = {}
#: (signed, device) → nearest_codes' table and midpoints; (signed, "edges", device) → the bins' least
#: values and widths (encode_correction); (signed, "bins", device) → bin_values
_TABLES: dict = {}


def fresh(slot: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """New memory for a codec temporary (the default scratch): the signature of
    :meth:`geomopt.optim.engine.workspace.Workspace.take`, which a caller passes instead to make
    the codec allocate nothing once its slots are taken at their largest (a chunked step:
    nothing allocates after its first write)."""
    return torch.empty(shape, dtype=dtype, device=device)


#: the codec's scratch slots (:func:`fresh`'s ``slot``) and their dtypes; each holds at most one
#: entry per value of a piece (:meth:`Codec.reserve`)
SCRATCH = {"codec.f0": torch.float32, "codec.f1": torch.float32, "codec.f2": torch.float32, "codec.i0": torch.int32,
           "codec.i1": torch.int32, "codec.i2": torch.int32, "codec.i3": torch.int32, "codec.l0": torch.int64,
           "codec.u0": torch.uint8, "codec.u1": torch.uint8, "codec.b0": torch.bool, "codec.h0": torch.bfloat16}


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic quantization map (arXiv:2110.02861 §2.2, from Dettmers
    2016, arXiv:1511.04561): for exponent e = 0 … 6, 2^(e+f) + 1 fraction points spaced evenly in
    [0.1, 1] (f = 0 signed, 1 unsigned), whose midpoints, times 10^(e−6), are codes (negated too
    when signed); then zero and 1 (signed: one more run of midpoints at the top exponent fills the
    256). Made by :func:`map_values` in exact integer arithmetic, so it has the same bits on every
    machine (``torch.linspace``'s points differ by an ulp between CPU kernels)."""
    key = bool(signed)
    if key not in _MAPS:
        _MAPS[key] = map_values(torch.arange(256), key)
    return _MAPS[key]


#: 0.1 and 1 − 0.1 in float32 as integers over 2²⁷: the first point of every decade's linspace and its span
TENTH, SPAN = 13421773, 120795952
#: 10^(e − 6) in float32, e = 0 … 6: a decade's scale
POWERS = [float(torch.tensor(10.0 ** (e - 6), dtype=torch.float32)) for e in range(7)]


def map_values(c: torch.Tensor, signed: bool) -> torch.Tensor:
    """The dynamic map's value of each code ``c`` (integers in [0, 256)): a decade code's rank L from
    the zero code (signed: |c − 127|; unsigned: c + 1, the fraction's extra bit) gives its decade
    e = ⌊log₂ L⌋ − f and fraction index j = L − 2^⌊log₂ L⌋, and its value is the midpoint of the
    fraction points j and j + 1 (:func:`_edge`) times 10^(e − 6), negated below the zero code; the
    zero code and 255 (1) apart. Every op is one IEEE rounding, so the bits are the same on every
    machine: those of the vectorized float32 ``torch.linspace`` (torchao's map, on a CPU with AVX2)."""
    c = c.to(torch.int32)
    rank = (c - 127).abs() if signed else c + 1
    k = ((rank.float().view(torch.int32) >> 23) - 127).clamp(min=0)  # ⌊log₂ L⌋ from the float's exponent
    j = rank - torch.bitwise_left_shift(torch.ones_like(k), k)
    half = (torch.bitwise_left_shift(torch.ones_like(k), k) + 1) >> 1  # linspace's turn: (2^k + 1) // 2
    mid = (_edge(j, k, half) + _edge(j + 1, k, half)) / 2
    e = k - (0 if signed else 1)
    scale = torch.full_like(mid, POWERS[0])
    for d in range(1, 7):
        scale = torch.where(e == d, POWERS[d], scale)
    v = mid * scale
    zero = 127 if signed else 0
    if signed:
        v = torch.where(c < zero, -v, v)
    return torch.where(c == 255, 1.0, torch.where(c == zero, 0.0, v))


def _edge(i: torch.Tensor, k: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Point ``i`` of ``linspace(0.1, 1, 2^k + 1)`` in float32 rounded once from its exact value (as
    the vectorized kernel's fused multiply-add does): 0.1 + step·i below ``half``, 1 − step·(2^k − i)
    from it; the exact value is an integer over 2^(27+k) (< 2³⁵: int64), converted (the one rounding)
    and scaled by that power of two (exact)."""
    i64, n = i.to(torch.int64), torch.bitwise_left_shift(torch.ones_like(k), k).to(torch.int64)
    up = (TENTH * n + SPAN * i64).float()
    down = ((1 << 27) * n - SPAN * (n - i64)).float()
    scale = ((100 - k) << 23).view(torch.float32)  # 2^(−27−k): the exponent field 127 − 27 − k
    return torch.where(i < half, up, down) * scale


def scale_shape(row_shape: tuple, per: int = BLOCK) -> tuple:
    """The shape of one tensor's int8 block scales: its shape with the last dim in blocks of 256, or
    one per block of the flattened tensor where the last dim is not a multiple of 256. ``per=2``:
    the shape of its ``int8-ec`` correction (two 4-bit entries to a byte), cut as the scales are."""
    if row_shape and row_shape[-1] % BLOCK == 0:
        return (*row_shape[:-1], row_shape[-1] // per)
    return (math.prod(row_shape) // per,)


def side_shape(key: str, row_shape: tuple) -> tuple:
    """The shape of the side entry ``key`` (``<moment>_absmax`` or ``<moment>_ec``) of a tensor shaped
    ``row_shape``."""
    return scale_shape(row_shape, 2 if key.endswith(CORRECTION) else BLOCK)


def encode_int8(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 shaped as ``x``, per-block largest magnitudes (…, numel/256)) of a stacked
    tensor ``x`` (rows: tensors; blocks never straddle two tensors)."""
    scaled, absmax = block_scaled(x)
    absmax = absmax.clone()
    codes = nearest_codes(scaled, signed)  # the nearest code; halfway: the upper one
    return codes.to(torch.uint8).reshape(x.shape), absmax


def block_scaled(x: torch.Tensor, take=fresh,
                 absmax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each entry of a stacked ``x`` over its block's largest magnitude, flat float32; those
    magnitudes (…, numel/256), written into ``absmax`` where given): what :func:`encode_int8`
    codes. ``take``: where the temporaries live (:func:`fresh`)."""
    rows = x.reshape(x.shape[0], -1, BLOCK).float()
    mags = torch.abs(rows, out=take("codec.f0", (rows.numel(),), torch.float32, x.device).view(rows.shape))
    blocks = rows.shape[0] * rows.shape[1]
    side = take("codec.f1", (2 * blocks,), torch.float32, x.device)
    absmax = torch.amax(mags, -1, out=(side[:blocks] if absmax is None else absmax).view(rows.shape[:2]))
    low = torch.clamp(absmax, min=1e-12, out=side[blocks:].view(absmax.shape))
    return torch.div(rows, low.unsqueeze(-1), out=mags).reshape(-1), absmax


def nearest_codes(scaled: torch.Tensor, signed: bool, take=fresh) -> torch.Tensor:
    """The index of the dynamic map's code nearest each entry of the 1-D float32 ``scaled``, a value
    halfway between two codes taking the upper one: ``torch.bucketize(scaled, midpoints,
    right=True)``, by a table instead of a binary search per entry (five times faster on a CPU). The
    17 high bits of a float32 (sign, exponent, 8 mantissa bits) name a bin of relative width 2⁻⁸,
    narrower than the map's finest relative spacing (2⁻⁷·0.9), so at most one midpoint falls inside
    a bin: the table holds the code of each bin's least value, and one comparison with the next
    midpoint finishes. ±∞ take the end codes and NaN the last, as bucketize gives them. ``take``:
    where the temporaries and the (int32) codes live (:func:`fresh`)."""
    key = (bool(signed), scaled.device)
    if key not in _TABLES:
        mids = (dynamic_map(signed)[1:] + dynamic_map(signed)[:-1]) / 2
        high = (torch.arange(1 << 17, dtype=torch.int64) - (1 << 16)).to(torch.int32) << 15
        # a bin's least value: its low bits clear, or set where negative
        least = torch.where(high < 0, high | 0x7FFF, high).view(torch.float32)
        least = torch.where(high.view(torch.float32) == -math.inf, -math.inf, least)  # not the NaN beside −∞
        table = torch.bucketize(least, mids, right=True).to(torch.int32)
        nxt = torch.cat([mids, torch.tensor([math.nan])])  # after the last code: no midpoint (x ≥ NaN is false)
        _TABLES[key] = (table.to(scaled.device), nxt.to(scaled.device))
    table, nxt = _TABLES[key]
    n, device = scaled.numel(), scaled.device
    index = torch.bitwise_right_shift(scaled.view(torch.int32), 15, out=take("codec.i0", (n,), torch.int32, device))
    codes = torch.index_select(table, 0, index.add_(1 << 16), out=take("codec.i1", (n,), torch.int32, device))
    above = torch.index_select(nxt, 0, codes, out=take("codec.f1", (n,), torch.float32, device))
    return codes.add_(torch.ge(scaled, above, out=take("codec.b0", (n,), torch.bool, device)))


def decode_int8(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, take=fresh,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 values of a stack of codes (rows: tensors) and their block scales (any shape holding
    a row's blocks in order), written into ``out`` (contiguous, as many entries) where given."""
    key = (bool(signed), "map", codes.device)
    if key not in _TABLES:
        _TABLES[key] = dynamic_map(signed).to(codes.device)
    n, device = codes.numel(), codes.device
    index = take("codec.i0", (n,), torch.int32, device)
    index.copy_(codes.reshape(-1))
    rows = torch.index_select(_TABLES[key], 0, index, out=take("codec.f0", (n,), torch.float32, device))
    dest = take("codec.f1", (n,), torch.float32, device) if out is None else out
    shape = (codes.shape[0], -1, BLOCK)
    torch.mul(rows.view(shape), absmax.reshape(codes.shape[0], -1, 1), out=dest.view(shape))
    return dest.view(codes.shape) if out is None else out


def bin_edges(signed: bool) -> torch.Tensor:
    """The 257 edges of the codes' bins: code c takes the scaled values in [E_c, E_{c+1}) (what
    :func:`nearest_codes` gives it, the upper code at a midpoint): E_0 the least scaled value (−1
    signed, 0 unsigned), then the midpoints between neighbouring codes, then 1."""
    qmap = dynamic_map(signed)
    lo = torch.tensor([-1.0 if signed else 0.0])
    return torch.cat([lo, (qmap[1:] + qmap[:-1]) / 2, torch.tensor([1.0])])


def encode_correction(scaled: torch.Tensor, codes: torch.Tensor, signed: bool,
                      bits16: Optional[torch.Tensor], take=fresh) -> torch.Tensor:
    """The 4-bit corrections t ∈ {0 … 15} (uint8, one per entry) of the 1-D float32 ``scaled``
    (x / its block's scale) coded as ``codes``: 15·(scaled − E_c)/(E_{c+1} − E_c), its position in
    its bin (:func:`bin_edges`), clamped to [0, 15] (a value outside the map's range: the nearest
    end) and rounded up with probability its fraction, ``bits16`` a uniform 16-bit draw per entry
    (:func:`noise`; None: to the nearest). Non-finite values: 0. ``take``: where the temporaries and
    the result live (:func:`fresh`)."""
    key = (bool(signed), "edges", scaled.device)
    if key not in _TABLES:
        edges = bin_edges(signed)
        _TABLES[key] = (edges[:-1].to(scaled.device), (edges[1:] - edges[:-1]).to(scaled.device))
    lows, widths = _TABLES[key]
    n, device = scaled.numel(), scaled.device
    c = codes if codes.dtype in (torch.int32, torch.int64) else codes.int()
    pos = torch.index_select(lows, 0, c, out=take("codec.f1", (n,), torch.float32, device))
    width = torch.index_select(widths, 0, c, out=take("codec.f2", (n,), torch.float32, device))
    pos = torch.sub(scaled, pos, out=pos).div_(width).mul_(STEPS)
    pos = pos.clamp_(0, STEPS).nan_to_num_(0.0)
    if bits16 is None:
        pos.add_(0.5)
    else:
        pos.add_(width.copy_(bits16.reshape(-1)).div_(65536))  # exact: a 16-bit integer over 2¹⁶
    t = take("codec.u0", (n,), torch.uint8, device)
    return t.copy_(pos.floor_().clamp_(max=STEPS))


def decode_int8_ec(codes: torch.Tensor, corrections: torch.Tensor, absmax: torch.Tensor,
                   signed: bool, take=fresh, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 values a·(E_c + t/15·(E_{c+1} − E_c)) of a stack of codes c (rows: tensors), their
    4-bit corrections t (uint8, one per entry, shaped as the codes) and block scales a (any shape
    holding a row's blocks in order): one look-up of c·16 + t in the 4096 values E_c + t/15·w_c
    (:func:`bin_values`), times a; written into ``out`` (contiguous, as many entries) where given."""
    table = bin_values(signed, codes.device)
    n, device = codes.numel(), codes.device
    index = take("codec.i0", (n,), torch.int32, device)
    index.copy_(codes.reshape(-1)).bitwise_left_shift_(4).bitwise_or_(corrections.reshape(-1))
    rows = torch.index_select(table, 0, index, out=take("codec.f0", (n,), torch.float32, device))
    dest = take("codec.f1", (n,), torch.float32, device) if out is None else out
    shape = (codes.shape[0], -1, BLOCK)
    torch.mul(rows.view(shape), absmax.reshape(codes.shape[0], -1, 1), out=dest.view(shape))
    return dest.view(codes.shape) if out is None else out


def bin_values(signed: bool, device) -> torch.Tensor:
    """The 4096 values E_c + t/15·(E_{c+1} − E_c) a code c and its correction t decode to (before the
    block scale), at c·16 + t (t = 15 never occurs past the last code's 1; every t is a value of
    the bin)."""
    key = (bool(signed), "bins", device)
    if key not in _TABLES:
        edges = bin_edges(signed)
        lo, hi = edges[:-1].unsqueeze(1), edges[1:].unsqueeze(1)
        t = torch.arange(16, dtype=torch.float32) / STEPS
        _TABLES[key] = (lo + t * (hi - lo)).reshape(-1).to(device)
    return _TABLES[key]


def pack4(t: torch.Tensor, out: Optional[torch.Tensor] = None, take=fresh) -> torch.Tensor:
    """Two 4-bit values (uint8 in [0, 16)) to a byte, entry 2i in the low half: the flat ``t`` of even
    size as uint8 of half its size (written into ``out`` where given, the shifted high halves in
    ``take``'s scratch: contiguous writes only, which a compiled caller can make too)."""
    pairs = t.reshape(-1, 2)
    if out is None:
        return pairs[:, 0] | (pairs[:, 1] << 4)
    high = torch.bitwise_left_shift(pairs[:, 1], 4, out=take("codec.u1", (pairs.shape[0],), torch.uint8, t.device))
    return torch.bitwise_or(pairs[:, 0], high, out=out)


def unpack4(packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`pack4`: the flat 4-bit values, twice ``packed``'s size (written into ``out``,
    uint8, where given): each byte shifted right by 0 and by 4 in one broadcast op, then its low 4
    bits (one contiguous write, which a compiled caller can make too)."""
    flat = packed.reshape(-1, 1)
    if out is None:
        return torch.cat([flat & 0xF, flat >> 4], 1).reshape(-1)
    key = ("shifts", packed.device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    torch.bitwise_right_shift(flat, _TABLES[key], out=out.view(-1, 2))
    return out.bitwise_and_(0xF)


def tables(device) -> None:
    """Every table the codec reads on ``device`` made now (the code search's, the maps, the bins', the
    unpacking's shifts), so a compiled caller finds them made (constants of its graph)."""
    one = torch.zeros(BLOCK, device=device)
    for signed in (True, False):
        codes = nearest_codes(one, signed)
        decode_int8(codes.view(1, -1), one[:1], signed)
        encode_correction(one, codes, signed, None)
        bin_values(signed, device)
    unpack4(torch.zeros(1, dtype=torch.uint8, device=device), torch.empty(2, dtype=torch.uint8, device=device))


def seed_of(*parts) -> int:
    """A 32-bit seed from ``parts`` (CRC-32 of their text)."""
    return zlib.crc32("|".join(map(str, parts)).encode())


def noise(seeds: Sequence[int], shape: tuple, start: tuple = (), full: tuple = (), lo: int = 0,
          hi: Optional[int] = None, device="cpu", take=fresh) -> torch.Tensor:
    """16 uniform random bits (int32) per entry of a stack of tensors of ``shape`` (rows: tensors):
    row r's entries are those at offset ``start`` (per dim; none: 0) of a whole tensor of shape
    ``full`` (none: ``shape[1:]``), and each draw is a hash of the entry's flat index there and
    ``seeds[r]`` (:func:`mix`). The same entry of the same tensor draws the same bits whichever
    shard holds it. ``lo``, ``hi``: only the entries [lo, hi) of the stack in row-major order, flat
    (what :class:`Codec` encodes at a time); by default all of them, shaped as the stack. The seeds
    are host integers: the bits are made on ``device`` with no read back. ``take``: where the bits
    and the temporaries live (:func:`fresh`)."""
    rows = tuple(shape[1:])
    n = max(math.prod(rows), 1)
    end = len(seeds) * n if hi is None else hi
    out = take("codec.i3", (end - lo,), torch.int32, device)  # a slot of its own: the bits outlive the code search
    for r in range(lo // n, -(-end // n)):  # the rows the range meets, each in one piece
        a, b = max(lo, r * n) - r * n, min(end, (r + 1) * n) - r * n
        part = out[r * n + a - lo: r * n + b - lo]
        mix(_index(a, b, rows, start, full, device, part, take), int(seeds[r]), take)
    return out.reshape(shape) if hi is None and lo == 0 else out


def flat_noise(seed: torch.Tensor, lo: torch.Tensor, n: int, device) -> torch.Tensor:
    """:func:`noise`'s bits of the entries [lo, lo + n) of one whole tensor (one process, flat order),
    its seed given as an int32 0-d tensor (:func:`signed`) and ``lo`` as an int64 0-d tensor, so that a
    compiled caller takes both as graph inputs (no compile per step or per chunk)."""
    index = (torch.arange(n, dtype=torch.int64, device=device) + lo).to(torch.int32)
    return mix(index, seed)


def signed(seed: int) -> int:
    """A 32-bit seed (:func:`seed_of`) as the int32 it is xored in as (two's complement)."""
    return seed - (1 << 32) if seed >= 1 << 31 else seed


def _index(a: int, b: int, rows: tuple, start: tuple, full: tuple, device, out: torch.Tensor,
           take=fresh) -> torch.Tensor:
    """int32 flat indices, in the whole tensor of shape ``full``, of the entries [a, b) (row-major)
    of its block of shape ``rows`` at offset ``start``, written into ``out``: a range where only the
    first dim is cut (one process, FSDP2's rows), else unravelled dim by dim (which allocates)."""
    full = tuple(full) or rows
    start = tuple(start) or (0,) * len(rows)
    if tuple(full[1:]) == tuple(rows[1:]):
        offset = start[0] * math.prod(full[1:]) if rows else 0
        wide = take("codec.l0", (b - a,), torch.int64, device)
        return out.copy_(torch.arange(a + offset, b + offset, out=wide))
    j = torch.arange(a, b, dtype=torch.int64, device=device)
    idx = torch.zeros_like(j)
    stride = 1
    for d in reversed(range(len(rows))):
        idx += (j % rows[d] + start[d]) * stride
        j //= rows[d]
        stride *= full[d]
    return out.copy_(idx)


def mix(x: torch.Tensor, seed, take=fresh) -> torch.Tensor:
    """The 16 low bits of a 32-bit integer hash of int32 ``x`` ⊕ ``seed``, in place: x ← (x ⊕ x≫16)·
    0x45d9f3b twice, then x ⊕ x≫16 (a well-mixing multiply-xorshift; ≫ logical, products mod 2³²,
    which int32 arithmetic wraps to). ``seed``: a 32-bit integer, or an int32 0-d tensor holding
    :func:`signed` of one. ``take``: where the shifted copy lives (:func:`fresh`)."""
    shifted = take("codec.i2", (x.numel(),), torch.int32, x.device).view(x.shape)
    x.bitwise_xor_(seed if isinstance(seed, torch.Tensor) else signed(seed))
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF)).mul_(0x45D9F3B)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF))
    return x.bitwise_and_(0xFFFF)


def encode_bf16(x: torch.Tensor, bits16: Optional[torch.Tensor], take=fresh,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 of float32 ``x`` by stochastic rounding: the 16 low bits plus ``bits16`` (a uniform 16-bit
    draw per entry, :func:`noise`; None: round toward zero), carried into the kept bits, then
    truncated (exact: the low bits are zero); written into ``out`` (bf16, as many entries) where
    given. ``take``: where the temporaries live (:func:`fresh`)."""
    flat = x.float().contiguous().reshape(-1)
    n, device = flat.numel(), flat.device
    raw = take("codec.i1", (n,), torch.int32, device)
    if bits16 is None:
        raw.copy_(flat.view(torch.int32))
    else:
        torch.add(flat.view(torch.int32), bits16.reshape(-1), out=raw)
    raw.bitwise_and_(-65536)  # 0xFFFF0000 as an int32
    mags = take("codec.f0", (n,), torch.float32, device)
    finite = torch.lt(torch.abs(flat, out=mags), math.inf, out=take("codec.b0", (n,), torch.bool, device))
    # |x| < ∞ is false at ±∞ and NaN, which keep their own bf16; the rest is exact in bf16 (low bits 0)
    kept = torch.where(finite, raw.view(torch.float32), flat, out=mags)
    dest = take("codec.h0", (n,), torch.bfloat16, device) if out is None else out.view(-1)
    dest.copy_(kept)
    return dest.view(x.shape) if out is None else out
