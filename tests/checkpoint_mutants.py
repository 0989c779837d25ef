"""Mutated optimizer state dicts: the generator that tests/test_load_fuzz.py (hypothesis) and
``scripts/fuzz.py --checkpoints`` (seeded, replayable) share.

Every mutation draws through a :class:`Choose`: :class:`Drawn` asks hypothesis (which shrinks a
failing example), :class:`Seeded` a ``random.Random`` seeded by (seed, i), so checkpoint mutant
``i`` of seed ``S`` is the same on every run. The state dicts mutated are those of :data:`SPECS`
(batched and flat programs, every state precision), each saved after two steps of a tiny GPT.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

import geomopt
from optim_helpers import gpt_batch, loss_of, tiny_gpt
from test_atomic_step import PRECISION

#: the specs whose checkpoints are mutated: batched and flat programs, every state precision
SPECS = ["muon", "adamw-hybrid", "sign-descent", "prox-muon-frobenius", "int8", "bfloat16", "int8-ec"]
_BASES: dict = {}


class Choose:
    """Where a mutation's choices come from."""

    def one(self, options: Sequence) -> Any:
        raise NotImplementedError

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def real(self, lo: float, hi: float) -> float:
        raise NotImplementedError

    def text(self, max_size: int) -> str:
        raise NotImplementedError

    def boolean(self) -> bool:
        return bool(self.one([False, True]))


class Drawn(Choose):
    """Choices drawn by hypothesis (``data`` from ``st.data()``)."""

    def __init__(self, data):
        self.data = data

    def one(self, options):
        return self.data.draw(st.sampled_from(list(options)))

    def integer(self, lo, hi):
        return self.data.draw(st.integers(lo, hi))

    def real(self, lo, hi):
        return self.data.draw(st.floats(lo, hi))

    def text(self, max_size):
        return self.data.draw(st.text(max_size=max_size))


#: characters a seeded text draws from: ASCII, a line break, a NUL, a lone surrogate, beyond the BMP
_CHARS = "abcXYZ09_. -'\"\n\x00\u00e9\u212a\ud800\U0001d7d8"


class Seeded(Choose):
    """Choices from ``random.Random`` seeded by (``seed``, ``i``): mutant ``i`` of ``seed`` alone."""

    def __init__(self, seed: int, i: int):
        self.rng = random.Random(seed * 1_000_003 + i)

    def one(self, options):
        options = list(options)
        return options[self.rng.randrange(len(options))]

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)

    def real(self, lo, hi):
        return self.one([lo, hi, 0.0, -0.0, 5e-324]) if self.rng.random() < 0.2 else self.rng.uniform(lo, hi)

    def text(self, max_size):
        return "".join(self.one(_CHARS) for _ in range(self.integer(0, max_size)))


def base(spec: str):
    """(optimizer stepped twice, its state dict, the gradients of a third batch by name): built once."""
    if spec not in _BASES:
        model = tiny_gpt(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = geomopt.GeomOptimizer(model, geomopt.parse_spec(PRECISION.format(dtype=spec))
                                        if spec in ("int8", "bfloat16", "int8-ec") else spec)
        grads = {}
        for k in range(3):
            model.zero_grad(set_to_none=True)
            loss_of(model, gpt_batch(k)).backward()
            if k < 2:
                opt.step()
            else:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        _BASES[spec] = (opt, copy.deepcopy(opt.state_dict()), grads)
    return _BASES[spec]


_WORDS = ["polyak", "none", "heavy_ball", "lion", "storm", "dion", "magic", "skip", "raise", "off", "explode",
          "zero", "gradient", "yes"]


def value(c: Choose):
    """A value a mutation puts anywhere: wrong types, out-of-range and non-finite numbers, tensors
    of odd dtypes and shapes (magnitudes stay moderate: a spec may set lr = 1e30, which diverges as
    any such run does)."""
    kind = c.one(["none", "bool", "int", "huge", "float", "special", "text", "word", "list", "dict", "tensor"])
    if kind == "none":
        return None
    if kind == "bool":
        return c.boolean()
    if kind == "int":
        return c.integer(-3, 3)
    if kind == "huge":
        return c.one([10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 31])
    if kind == "float":
        return c.real(-3, 3)
    if kind == "special":
        return c.one([math.nan, math.inf, -math.inf, 1e-30])
    if kind == "text":
        return c.text(6)
    if kind == "word":
        return c.one(_WORDS)
    if kind == "list":
        return [c.integer(0, 3) for _ in range(c.integer(0, 3))]
    if kind == "dict":
        return {c.one(["kind", "horizon"]): c.one(["constant", "theory", 3, -1]) for _ in range(c.integer(0, 2))}
    return c.one([torch.tensor(0.5), torch.tensor(-1.0), torch.tensor(math.nan), torch.tensor(3), torch.tensor(-2),
                  torch.tensor(True), torch.zeros(2), torch.tensor(1 + 2j)]).clone()


DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int32, torch.int64, torch.bool,
          torch.complex64]


def tensor_mutation(c: Choose, t: torch.Tensor):
    """A tensor like ``t`` with its dtype, shape or values changed."""
    how = c.one(["dtype", "shape", "values", "scale"])
    if how == "dtype":
        dtype = c.one(DTYPES)
        return (t.float() * 100).to(dtype) if dtype in (torch.uint8, torch.int32, torch.int64) else t.to(dtype)
    if how == "shape":
        return torch.zeros(tuple(c.integer(0, 5) for _ in range(c.integer(0, 3))), dtype=t.dtype)
    if how == "scale":
        return t * c.one([-1.0, 0.0, 2.0, 1e3])
    out = t.clone()
    if out.numel():
        flat = out.view(-1)
        i = c.integer(0, flat.numel() - 1)
        if out.dtype == torch.uint8:
            flat[i] = c.integer(0, 255)
        elif out.is_floating_point():
            flat[i] = c.one([math.nan, math.inf, -math.inf, -1.0, 0.0, 5.0])
    return out


def nudged(c: Choose, v):
    """A value of the same type moved a little (a number scaled, a bool flipped, a count moved by
    one, a tensor scaled by a positive factor): mostly still valid, so loads that succeed are drawn too."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + c.one([-1, 1, 7])
    if isinstance(v, float):
        return v * c.one([0.5, 0.9, 1.1])
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v * c.one([0.5, 1.5])
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex:
        return v + c.one([-1, 1, 7])
    return v


def mutate(c: Choose, sd: dict) -> list:
    """One mutation of ``sd`` in place; returns the words a refusal may name it by (the key, the
    group's rule, the tensor)."""
    where = c.one(["group", "group", "state", "state", "state", "counters", "meta", "drop"])
    groups, state, meta = sd["param_groups"], sd["state"], sd["geomopt"]
    if not state:  # (an earlier mutation emptied it)
        where = "meta"
    if where == "group":
        g = c.one(groups)
        key = c.one(sorted(k for k in g if k not in ("params", "param_names")) + ["extra"])
        how = c.one(["drop", "value", "nudge", "nudge"])
        if how == "drop" and key in g and key not in ("lr", "rule"):
            del g[key]
        elif how == "nudge" and key in g:
            g[key] = nudged(c, g[key])
        else:
            g[key] = value(c)
        return [key, f"'{g.get('rule')}'", "param_groups"]
    if where in ("state", "drop"):
        names = {i: n for g in groups for i, n in zip(g["params"], g["param_names"])}
        pid = c.one(sorted(state))
        entry = state[pid]
        key = c.one(sorted(entry) + ["momentum_bufer", "step"])
        if where == "drop" and key in entry:
            del entry[key]
        elif isinstance(entry.get(key), torch.Tensor) and c.boolean():
            entry[key] = tensor_mutation(c, entry[key])
        elif key in entry and c.boolean():
            entry[key] = nudged(c, entry[key])
        else:
            entry[key] = value(c)
        return [key, names[pid]]
    if where == "counters" and isinstance(meta.get("counters"), list) and meta["counters"] and all(
            isinstance(x, dict) for x in meta["counters"]):
        i = c.integer(0, len(meta["counters"]) - 1)
        key = c.one(["skipped", "fallbacks", "update_sq"])
        meta["counters"][i][key] = value(c)
        return [key, "counters"]
    key = c.one(["world_size", "sharded", "mesh", "spec_hash", "pending", "transposed", "spec_groups", "counters"])
    meta[key] = value(c)
    return [key] + ["hash"] * (key == "spec_hash")  # (a changed hash: "saved under spec … (hash …)")


def mutant(c: Choose) -> tuple[str, dict, list]:
    """(spec, a mutated copy of its saved state dict, the words a refusal may name): 1 to 3 mutations."""
    spec = c.one(SPECS)
    sd = copy.deepcopy(base(spec)[1])
    named: list = []
    for _ in range(c.integer(1, 3)):
        named += mutate(c, sd)
    return spec, sd, named


def finite(opt) -> bool:
    """Parameters and every floating state tensor finite."""
    for g in opt.param_groups:
        for p in g["params"]:
            if not bool(torch.isfinite(p).all()):
                return False
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return False
    return True
