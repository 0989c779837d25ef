"""The compiled codec of a flat rule's state in a lower precision under ``GeomOptimizer(fuse=True)``:
an encoded Adam piece stepped whole in one call (:class:`EncodedAdam`: decode, Adam's arithmetic,
the write-back, encode), and another rule's decode and encode of each moment and piece, one kernel
each (:func:`compiled_decode`, :func:`compiled_encode`), all from the codec's own source
(:mod:`geomopt.optim.persist.state_codec`) and the units' functions, compiled and called through
:mod:`geomopt.optim.engine.fused` (its :func:`~geomopt.optim.engine.fused.run` is the one place a
compiled region is called)."""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch

from geomopt.geometry.adam import adam_hyper, adam_moments
from geomopt.optim.engine import fused
from geomopt.optim.engine.fused import compile_region, write_tail
from geomopt.optim.persist.codes import BLOCK, flat_noise, signed
from geomopt.optim.persist.state_codec import Codec, decode_piece, piece_of
from geomopt.optim.units.state_keys import CORRECTION, SCALE
from geomopt.spec.model import QUANTIZED

#: inductor's settings for the codec's functions: an intermediate realized (computed once into a
#: buffer) when read more than once (encode) or when it takes over 4 ops, where inductor by default
#: recomputes it in each consumer: the code search (a shift, two table look-ups, a compare) was run
#: again for the codes, the corrections' bins and their widths. Per piece of 2¹⁸ entries, one
#: thread on this project's loaded 2-core CPU: int8-ec's encode 11.8 ms → 1.9 ms, bf16's 0.43 →
#: 0.17, int8's 1.0 → 0.6; int8-ec's decode 1.7 → 0.75 (the same bits)
CODEC_OPTIONS = {"encode": {"realize_reads_threshold": 1, "realize_opcount_threshold": 4},
                 "decode": {"realize_opcount_threshold": 4}}


def decode_moment(out: torch.Tensor, stored: dict, *, key: str) -> None:  # compiled: compiled_decode
    """The float32 values of one piece of an encoded moment ``key`` into ``out`` (1-D):
    :func:`~geomopt.optim.persist.state_codec.decode_piece` on the piece's stored entries
    (:func:`~geomopt.optim.persist.state_codec.piece_of`), the same source the eager step runs."""
    decode_piece(stored, key, 0, out.numel(), out)


def encode_moment(stored: dict, x: torch.Tensor, seed: torch.Tensor, lo: torch.Tensor, *, dtype: str,
                  key: str) -> None:
    """One piece's float32 values ``x`` of the moment ``key`` encoded in ``dtype`` into its stored entries
    ``stored`` (:meth:`~geomopt.optim.persist.state_codec.Codec.encode_values`, the eager step's
    source), the random bits drawn for the entries [lo, lo + n) of the tensor under ``seed``
    (:func:`~geomopt.optim.persist.codes.flat_noise`: :func:`~geomopt.optim.persist.codes.noise`'s bits)."""
    codec = Codec(dtype)
    bits = flat_noise(seed, lo, x.numel(), x.device) if codec.rounds(key) else None
    codec.encode_values(key, x, bits, stored)


def encoded_adam(x: torch.Tensor, m: dict, v: dict, g: torch.Tensor, count: torch.Tensor, lr: torch.Tensor,
                 keep: torch.Tensor, m_seed: torch.Tensor, v_seed: torch.Tensor, lo: torch.Tensor, *, dtype: str,
                 geometry, decay: str, decays: bool) -> None:
    """One piece of an encoded Adam step, whole: its moments' stored entries ``m``, ``v``
    (:func:`~geomopt.optim.persist.state_codec.piece_of`) decoded (:func:`decode_moment`), Adam's
    moments and denominator (:func:`~geomopt.geometry.adam.adam_moments`, ``count`` the steps taken
    before this one), X ← X·keep − lr/bc₁·m/(√v/√bc₂ + ε) (:func:`write_tail`), and the new moments
    encoded back in place (:func:`encode_moment`, the entries [lo, lo + n) of their tensor seeded by
    ``m_seed``, ``v_seed``). Compiled (:func:`compiled_adam`): the float32 moments pass between
    inductor's loops inside one call, not through the workspace between five calls."""
    x, g = x.view(-1), g.view(-1)
    m, v = ({k: t.view(-1) for k, t in d.items()} for d in (m, v))
    one = torch.empty_like(x)
    two = torch.empty_like(x)
    decode_moment(one, m, key="exp_avg")
    decode_moment(two, v, key="exp_avg_sq")
    moments = {"exp_avg": one, "exp_avg_sq": two, "adam_step": count}
    exp_avg, denom, bc1 = adam_moments(g, moments, geometry)
    write_tail([x], [exp_avg / denom], keep, -lr / bc1, decay=decay, decays=decays)
    encode_moment(m, exp_avg, m_seed, lo, dtype=dtype, key="exp_avg")
    encode_moment(v, moments["exp_avg_sq"], v_seed, lo, dtype=dtype, key="exp_avg_sq")


#: (precision, (β₁, β₂, ε), decay, decays) → :func:`compiled_adam`'s function (an Adam geometry is no
#: dict key: its spec holds a list)
_ADAM: dict = {}


def compiled_adam(dtype: str, geometry, decay: str, decays: bool) -> Callable:
    """:func:`encoded_adam` compiled for one precision, Adam geometry (β₁, β₂, ε: constants) and decay."""
    key = (dtype, adam_hyper(geometry), decay, decays)
    if key not in _ADAM:
        # a code object per key: each compiles a graph or three (storage offsets), within torch's limit
        step = compile_region(_own_code(encoded_adam, dtype, str(len(_ADAM))), options=CODEC_OPTIONS["encode"],
                              dtype=dtype, geometry=geometry, decay=decay, decays=decays)

        def call(*args):
            for t in (args[0], args[3], *args[1].values(), *args[2].values()):
                torch._dynamo.maybe_mark_dynamic(t, 0)  # a piece of one block: 1, specialized
            return step(*args)

        _ADAM[key] = call
    return _ADAM[key]


class EncodedAdam:
    """An encoded Adam step's pieces run whole (:func:`compiled_adam`): one step's numbers as 0-d
    tensors (graph inputs: a schedule compiles nothing again), made once per step; a call steps one
    piece [a, b) of a tensor in place and returns True."""

    def __init__(self, dtype: str, pp, step: int, gamma: float, weight_decay: float, device):
        self.fn = compiled_adam(dtype, pp.geometry, pp.decay, bool(weight_decay))
        self.rows = BLOCK if dtype in QUANTIZED else None  # int8: pieces as (blocks, 256), a static inner dim
        self.numbers = [torch.tensor(v, dtype=torch.float64, device=device)
                        for v in (step - 1, gamma, 1 - gamma * weight_decay)]
        self.device = device

    def __call__(self, x: torch.Tensor, g: torch.Tensor, targets: dict, a: int, seeds: dict) -> None:
        keys = ("exp_avg", "exp_avg_sq")
        stored = [{k: self._rows(t, k) for k, t in piece_of(targets[key], a, a + x.numel()).items()} for key in keys]
        seed = [torch.tensor(signed(seeds[key][0]), dtype=torch.int32, device=self.device) for key in keys]
        fused.run(self.fn, [], [self._rows(x), *stored], [self._rows(g)], *self.numbers, *seed,
                  torch.tensor(a, dtype=torch.int64, device=self.device))

    def _rows(self, t: torch.Tensor, key: str = "") -> torch.Tensor:
        """A piece's flat tensor as int8's blocks (…, 256) (its corrections (…, 128), its scales flat),
        so the compiled code knows a block's size; bf16's as it is."""
        if self.rows is None or key.endswith(SCALE):
            return t
        return t.view(-1, self.rows // 2 if key.endswith(CORRECTION) else self.rows)


@functools.lru_cache(maxsize=None)
def compiled_decode(key: str) -> Callable:
    """:func:`decode_moment` compiled for one moment (its map: signed or not)."""
    return compile_region(_own_code(decode_moment, key), dynamic=True, options=CODEC_OPTIONS["decode"], key=key)


@functools.lru_cache(maxsize=None)
def compiled_encode(dtype: str, key: str) -> Callable:
    """:func:`encode_moment` compiled for one precision and moment."""
    return compile_region(_own_code(encode_moment, dtype, key), dynamic=True, options=CODEC_OPTIONS["encode"],
                          dtype=dtype, key=key)


def _own_code(fn: Callable, *choice: str) -> Callable:
    """``fn`` with a code object of its own for one ``choice`` (the same source): torch's compile cache
    and its recompile limit are per code object, and a codec function compiles, per choice, one graph
    for pieces at the start of their stored entries and one for pieces past it (a storage offset of
    0, 1 or more is a guard of its own), which would spend the limit of one shared code object."""
    name = "_".join((fn.__name__, *choice)).replace("-", "_")
    own = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own
