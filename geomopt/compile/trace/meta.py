"""Running a forward on the meta device: stand-ins for the ops that read values, and the meta
kernels' outputs remembered across a model's repeated blocks.

On meta no tensor has values. An op that reads one (``.item()``, ``bool(t)``, ``nonzero``, a copy to
the CPU for ``.tolist()``) gets a plausible stand-in (:func:`value_free`), so the common guards and
routing loops run; a forward that still needs values fails and the tracer falls back to a real one.
Many meta kernels are written in Python and cost up to milliseconds a call; a functional op's
outputs depend only on its inputs' metadata, so :func:`run_memoized` remembers them.
"""

from __future__ import annotations

import torch

from geomopt.compile.trace.families import GROUPED_MM

aten = torch.ops.aten

_FUNCTIONAL: dict = {}  # op → whether its outputs are fresh tensors (no alias, no mutation)


def _meta_key(x):
    """A hashable description of an op's arguments: a tensor by its metadata, containers by items."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta":
            raise TypeError("a real tensor's values may matter")
        return (tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (tuple, list)):
        return tuple(_meta_key(v) for v in x)
    return x


def value_free(func, args, kwargs):
    """On meta, ops that read values get plausible stand-ins: a scalar is 0 / False (an index, a
    count, a condition), ``nonzero`` finds every element, a copy to the CPU is zeros."""
    packet = func.overloadpacket
    if packet is aten._local_scalar_dense:
        t = args[0]
        return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
    if packet is aten.is_nonzero:
        return False
    if packet is aten.equal:
        return True
    if packet in GROUPED_MM and args[0].ndim in (2, 3) and args[1].ndim == 3:
        a, b = args[0], args[1]  # (tokens, k) × (experts, k, n) → (tokens, n); batched 3-D × 3-D
        shape = (a.shape[0], b.shape[-1]) if a.ndim == 2 else (a.shape[0], a.shape[1], b.shape[-1])
        out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 and args[4] is not None else a.dtype)
        return torch.empty(shape, dtype=out_dtype, device="meta")
    if packet is aten.nonzero:
        t = args[0]
        return torch.empty((t.numel(), t.ndim), dtype=torch.long, device="meta")
    if packet is aten._to_copy and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta":
        t = args[0]
        return torch.zeros(t.shape, dtype=kwargs.get("dtype") or t.dtype, device=kwargs["device"])
    return NotImplemented


def run_memoized(memo: dict, func, args, kwargs):
    """Run a meta kernel, or rebuild its outputs from the metadata of an earlier call with the
    same input metadata: the meta kernels written in Python cost up to milliseconds per call,
    and a model repeats its blocks. Only functional ops (no view, no in-place) are remembered."""
    if func not in _FUNCTIONAL:
        returns = func._schema.returns
        _FUNCTIONAL[func] = bool(returns) and not func._schema.is_mutable and all(
            r.alias_info is None and str(r.type) in ("Tensor", "Tensor[]") for r in returns)
    if not _FUNCTIONAL[func]:
        return func(*args, **kwargs)
    try:
        key = (func, _meta_key(args), _meta_key(tuple(kwargs.items())))
        hash(key)
    except TypeError:
        return func(*args, **kwargs)
    spec = memo.get(key)
    if spec is None:
        out = func(*args, **kwargs)
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else out
        memo[key] = (single, type(out), [(tuple(o.shape), o.stride(), o.dtype) for o in outs])
        return out
    single, kind, metas = spec
    outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in metas]
    return outs[0] if single else kind(outs)


__all__ = ["run_memoized", "value_free"]
