"""Repeated blocks traced once: a model's third and later identical blocks replayed from a summary.

A deep model repeats one block (a decoder layer, a ResNet stage's blocks) tens to hundreds of
times, and on the meta device each of its ops still costs a Python dispatch. The blocks are the
children of an ``nn.ModuleList`` or ``nn.Sequential`` sharing a class and their parameters' names,
shapes and dtypes (three or more; the outermost such blocks). The first two calls run under the
tracer as any other code, and each is summarized *relative to its own parameters and inputs*: the
layer calls it made (by parameter position), how each of its parameters was used, which of its
inputs' layers it fed, and its outputs' metadata and sources (its own layers, or its inputs'
passing through). When two consecutive calls give the same summary for the same input metadata
and non-tensor arguments (and the block's own boolean and string attributes: a per-layer
attention type), later calls with that key are replayed from it instead of run. A block
whose summary cannot be stated that way (a parameter used before, an output derived from a
parameter or carrying an input's features, an output that is not a tensor or a tuple of them)
is never replayed. Meta traces only: a real forward runs every block.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from geomopt.compile.trace.blocks import Feat
from geomopt.compile.trace.ops import Act

MIN_REPEATS = 3


def _scalar(x) -> Any:
    return x if x is None or isinstance(x, (bool, int, float, str)) else type(x).__name__


class Replayer:
    """Patches a model's repeated blocks for one meta trace (undone by :meth:`uninstall`);
    ``tracer`` is the :class:`geomopt.compile.trace.dispatch.Tracer`."""

    def __init__(self, tracer, model: nn.Module):
        self.tracer = tracer
        self.patched: list[nn.Module] = []
        self.state: dict[int, dict] = {}  # group id → {"last": (key, summary), "confirmed": {key: summary}}
        self.replayed = 0
        self._blocks(model)

    def _blocks(self, model: nn.Module) -> None:
        chosen: list[tuple[nn.Module, int]] = []
        inside: set[int] = set()
        for mod in model.modules():
            if id(mod) in inside or not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < MIN_REPEATS:
                continue
            groups: dict[tuple, list[nn.Module]] = {}
            for child in mod:
                sig = (type(child), tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()))
                if sig[1]:
                    groups.setdefault(sig, []).append(child)
            for members in groups.values():
                if len(members) >= MIN_REPEATS and all("forward" not in vars(m) for m in members):
                    chosen += [(m, id(members[0])) for m in members]
                    inside.update(id(sub) for m in members for sub in m.modules())
        for mod, group in chosen:
            mod.forward = functools.partial(self._call, mod, group, type(mod).forward.__get__(mod))
            self.patched.append(mod)

    def uninstall(self) -> None:
        """Give every block its own ``forward`` back (the patches are instance attributes)."""
        for mod in self.patched:
            vars(mod).pop("forward", None)

    # ------------------------------------------------------------ one block call

    def _call(self, mod: nn.Module, group: int, forward, *args, **kwargs):
        tr = self.tracer
        params = [p for _, p in mod.named_parameters()]
        index = [tr.param_index(p) for p in params]
        if any(i is None for i in index):
            return forward(*args, **kwargs)
        inputs = tr.tensors_of(args) + tr.tensors_of(kwargs)
        # the inputs' metadata, the non-tensor arguments, and the block's own flags and names (a
        # per-layer attention type: layers that differ so must not share a summary; a layer index
        # is an int and left out, or no layer would ever match the one before)
        flags = tuple((k, v) for k, v in vars(mod).items() if isinstance(v, (bool, str)) and not k.startswith("_"))
        key = (tuple(self._describe(a) for a in args), tuple((k, self._describe(v)) for k, v in kwargs.items()),
               flags)
        state = self.state.setdefault(group, {"last": None, "confirmed": {}})
        summary = state["confirmed"].get(key)
        if summary is not None:
            self.replayed += 1
            return self._replay(summary, index, inputs)
        c0, log0 = len(tr.calls), len(tr.fed_log)
        fresh = all(not tr.uses[i] for i in index)
        out = forward(*args, **kwargs)
        summary = self._summarize(index, inputs, out, c0, log0) if fresh else None
        if summary is not None and state["last"] == (key, summary):
            state["confirmed"][key] = summary
        state["last"] = (key, summary)
        return out

    def _describe(self, x) -> Any:
        tr = self.tracer
        if isinstance(x, torch.Tensor):
            act = tr.acts.get(x)
            kind = "ref" if x in tr.refs else "const" if act is None else ("act", act.raw, act.feat is None)
            return (tuple(x.shape), x.stride(), x.dtype, kind)
        if isinstance(x, (tuple, list)):
            return tuple(self._describe(v) for v in x)
        return _scalar(x)

    def _summarize(self, index: list[int], inputs: list, out, c0: int, log0: int) -> Optional[tuple]:
        """The call's effect relative to its parameters (positions in ``index``) and ``inputs``."""
        tr = self.tracer
        pos = {i: k for k, i in enumerate(index)}
        calls = []
        for c in range(c0, len(tr.calls)):
            if not all(i in pos for i in tr.calls[c]):
                return None  # a layer of a parameter outside the block (a shared table)
            calls.append(tuple(sorted(pos[i] for i in tr.calls[c])))
        srcs = [tr.src(t) for t in inputs]
        added = tr.fed_log[log0:]
        internal_fed = tuple(sorted({c - c0 for c in added if c >= c0}))
        external = {c for c in added if c < c0}
        inputs_fed = tuple(bool(s) and s <= tr.fed for s in srcs)
        if not external <= frozenset().union(*(s for s, f in zip(srcs, inputs_fed) if f)):
            return None
        outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, tuple) else None
        if outs is None:
            return None
        out_specs: list[Any] = []
        for o in outs:
            if o is None:
                out_specs.append(None)
                continue
            if not isinstance(o, torch.Tensor) or o in tr.refs:
                return None
            act = tr.acts.get(o)
            meta = (tuple(o.shape), o.stride(), o.dtype)
            if act is None:
                out_specs.append((meta, None))
                continue
            # layers known to feed another can never be heads: leaving them out is exact (the
            # tracer prunes them too, at its own pace) and makes the summary canonical
            own = tuple(sorted(c - c0 for c in act.src if c >= c0 and c not in tr.fed))
            rest = {c for c in act.src if c < c0 and c not in tr.fed}
            passing = tuple(k for k, s in enumerate(srcs) if s & rest)
            if not rest <= frozenset().union(*(srcs[k] for k in passing)):
                return None
            feat = act.feat
            if feat is not None and feat.layer < c0:
                return None  # an input's features passing through
            feat_rel = None if feat is None else (feat.layer - c0, feat.dim, feat.size, feat.k)
            out_specs.append((meta, (own, passing, act.raw, feat_rel)))
        uses = tuple(tuple(sorted(tr.uses[i].items())) for i in index)
        per_param = tuple((tr.batched[i], tr.stems[i], tr.reads_input[i], frozenset(tr.pieces.get(i, ())),
                           tr.lead[i], tuple(tr.view_ops[i])) for i in index)
        kind = "tensor" if isinstance(out, torch.Tensor) else "tuple"
        return (tuple(calls), internal_fed, inputs_fed, kind, tuple(out_specs), uses, per_param)

    def _replay(self, summary: tuple, index: list[int], inputs: list):
        tr = self.tracer
        calls, internal_fed, inputs_fed, kind, out_specs, uses, per_param = summary
        base = len(tr.calls)
        for rel in calls:
            tr.calls.append(frozenset(index[k] for k in rel))
        tr.mark_fed(base + c for c in internal_fed)
        srcs = [tr.src(t) for t in inputs]
        for s, fed in zip(srcs, inputs_fed):
            if fed:
                tr.mark_fed(s)
        for i, items, (batched, stem, reads, pieces, lead, view_ops) in zip(index, uses, per_param):
            for family, use in items:
                tr.uses[i].setdefault(family, use)
            tr.batched[i] |= batched
            tr.stems[i] = tr.stems[i] or stem
            tr.reads_input[i] |= reads
            if pieces:
                tr.pieces.setdefault(i, set()).update(pieces)
            tr.lead[i] = tr.lead[i] or lead
            tr.view_ops[i].update(dict.fromkeys(view_ops))
        outs: list[Any] = []
        for spec in out_specs:
            if spec is None:
                outs.append(None)
                continue
            (shape, stride, dtype), act = spec
            o = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if act is not None:
                own, passing, raw, feat = act
                src = frozenset(base + c for c in own).union(*(srcs[k] for k in passing))
                src = frozenset(c for c in src if c not in tr.fed)
                tr.acts[o] = Act(src, raw, None if feat is None else Feat(base + feat[0], *feat[1:]))
            outs.append(o)
        return outs[0] if kind == "tensor" else tuple(outs)


__all__ = ["Replayer"]
