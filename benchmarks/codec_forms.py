"""The int8 codec's table look-ups against closed forms of the same bits, compiled and timed.

    python benchmarks/codec_forms.py [--iters 30] [--sweep]

The codec (:mod:`geomopt.optim.persist.codes`) decodes a code by a look-up in the 256 values of the
dynamic map and finds a value's code by a look-up in a 2¹⁷-entry table and one comparison with the
next midpoint; inductor's CPU code does each look-up one lane at a time. The closed forms give the
same bits without a table: :func:`~geomopt.optim.persist.codes.map_values` (which makes the map
itself), a code's value from its decade and fraction index, and :func:`search`, a value's code from
its decade and fraction (a guess at most one below the code) and one comparison with the next
midpoint, itself made from :func:`map_values`. Each is first checked (the map's 256 values bit for
bit; the search against ``torch.bucketize`` on every float32 in [−1, 1] with ``--sweep``, else a
dense sample, every midpoint ±3 ulp and the specials), then compiled alone and timed on 2¹⁸ entries,
one thread, round robin in the thread's CPU time, beside the codec's own look-ups compiled the same
way.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from geomopt.optim.persist.codes import decode_int8, dynamic_map, map_values, nearest_codes, tables

#: the least value of decades 1 … 6 (10^(e − 7)), in float32
FLOORS = [float(torch.tensor(10.0 ** (e - 7), dtype=torch.float32)) for e in range(1, 7)]


def _guess(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """A code at most one below ``x``'s nearest (the upper one at a midpoint). A decade's codes sit at
    fractions p = (y/10^(e−6) − 0.1)·2^(e+f)/0.9 + ½ of their rank, their midpoints at whole p, the
    midpoint with the decade below at p = 0.2: the rank ⌊p − 0.25⌋ is the code or the one below it
    (⌊p + 0.5⌋ mirrored below zero, where the upper code is the smaller in magnitude), the decade from
    six comparisons, one multiply-subtract per entry."""
    f = 0 if signed else 1
    y = x.abs() if signed else x  # unsigned: below zero is below every midpoint
    slope = torch.full_like(y, 2**f / 0.9 * 1e6)
    shift = torch.full_like(y, 2**f / 9 + 0.25)
    for e in range(1, 7):
        above = y >= FLOORS[e - 1]
        slope = torch.where(above, 2 ** (e + f) / 0.9 * 10.0 ** (6 - e), slope)
        shift = torch.where(above, 2 ** (e + f) / 9 + 0.25 - (2 ** (e + f) - 2**f), shift)
    q = y * slope - shift  # the rank among the decade codes, less a quarter
    top = 2 ** (7 + f) - 2**f  # the decade codes: 127 signed, 254 unsigned; the rank of 1
    up = torch.floor(q).clamp(-1, top).nan_to_num(top)
    if not signed:
        return up.to(torch.int32) + 1
    down = torch.floor(q + 0.75).clamp(-1, top - 1)
    return torch.where(x < 0, 126 - down, 128 + up).to(torch.int32)


def search(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """:func:`~geomopt.optim.persist.codes.nearest_codes`'s codes (int32) of the float32 ``x``: the guess
    (:func:`_guess`) plus one where ``x`` reaches the next midpoint (the mean of the two codes' values,
    :func:`map_values`, as the codec's midpoints are made)."""
    g = _guess(x, signed)
    nxt = (g + 1).clamp(max=255)
    mid = (map_values(g, signed) + map_values(nxt, signed)) / 2
    return g + ((x >= mid) & (g < 255)).to(torch.int32)


def samples(signed: bool) -> torch.Tensor:
    """Values to check :func:`search` on: every midpoint of the map ±3 ulp and negated, 2²² evenly in
    [−1.5, 1.5], 2²² random bit patterns, the map's codes, and ±0, ±∞, NaN, 1, the least subnormals."""
    q = dynamic_map(signed)
    bits = ((q[1:] + q[:-1]) / 2).view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 1e-45, -1e-45, 2.0, -2.0])
    return torch.cat([near, -near, torch.linspace(-1.5, 1.5, 1 << 22), rand.view(torch.float32), q, -q, special])


def mismatches(signed: bool, xs=None) -> tuple[int, int]:
    """(codes whose :func:`map_values` differs from the map in any bit, values of :func:`samples` (or
    ``xs``) whose :func:`search` differs from ``torch.bucketize`` on the codec's midpoints: the
    codec's search, but at the NaNs that share −∞'s 17 high bits, which its table codes 0)."""
    q = dynamic_map(signed)
    values = int((map_values(torch.arange(256), signed).view(torch.int32) != q.view(torch.int32)).sum())
    xs = samples(signed) if xs is None else xs
    want = torch.bucketize(xs, (q[1:] + q[:-1]) / 2, right=True)
    return values, int((search(xs, signed) != want).sum())


def sweep(signed: bool) -> int:
    """:func:`search` against the codec's search on every float32 in [−1, 1] (both signs, ±0 to ±1), in
    pieces of 2²⁴; the values that differ."""
    bad = 0
    for sign in (0, -(1 << 31)):
        for lo in range(0, 0x3F800001, 1 << 24):
            bits = torch.arange(lo, min(lo + (1 << 24), 0x3F800001), dtype=torch.int64) + sign
            bad += mismatches(signed, bits.to(torch.int32).view(torch.float32))[1]
    return bad


def _forms(signed: bool, m: torch.Tensor) -> dict:
    """The forms :func:`timings` compiles: the codec's search and decode (block scales ``m``), and the
    closed forms of each."""
    return {"search, table": lambda x: nearest_codes(x, signed),
            "search, closed form": lambda x: search(x, signed),
            "decode, table": lambda c: decode_int8(c.view(1, -1), m, signed).view(-1),
            "decode, closed form": lambda c: (map_values(c, signed).view(-1, 256) * m.view(-1, 1)).view(-1)}


def timings(iters: int, n: int = 1 << 18) -> dict:
    """Median CPU ms of each form compiled alone on ``n`` entries, one thread, round robin."""
    torch.set_num_threads(1)
    tables("cpu")
    gen = torch.Generator().manual_seed(0)
    out = {}
    for signed in (True, False):
        x = torch.randn(n, generator=gen)
        x = x / x.abs().amax() if signed else x * x / (x * x).amax()
        c = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        m = torch.rand(n // 256, generator=gen)
        runs = {k: (torch.compile(fn, dynamic=True), x if k.startswith("search") else c)
                for k, fn in _forms(signed, m).items()}
        times: dict = {k: [] for k in runs}
        for r in range(iters + 2):
            for k, (fn, arg) in (list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]):
                t0 = time.thread_time()
                fn(arg)
                if r >= 2:
                    times[k].append(time.thread_time() - t0)
        out.update({("signed" if signed else "unsigned", k): statistics.median(t) * 1e3 for k, t in times.items()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="check the search on every float32 in [-1, 1] (minutes)")
    args = p.parse_args(argv)
    for signed in (True, False):
        values, codes = mismatches(signed)
        line = f"{'signed' if signed else 'unsigned'}: map values differing {values}, search codes differing {codes}"
        print(line + (f", over every float32 in [-1, 1] {sweep(signed)}" if args.sweep else ""))
    print("\n| map | form | ms (median, 2^18 entries) |\n|---|---|---|")
    for (kind, form), ms in timings(args.iters).items():
        print(f"| {kind} | {form} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
