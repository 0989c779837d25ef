"""Roles from use: one forward of the model under a dispatch-level tracer.

:func:`trace_model` runs the model once — on the meta device when it can (no memory, no
compute), else one tiny forward on the model's own device — and records, for every parameter
followed through view-like ops (views, casts, selects, index gathers, and ops that read only
parameters: weight norm, ``-exp(A_log)``), how it is consumed (:mod:`geomopt.compile.trace.families`):
a matrix operand, a full or grouped convolution kernel, a lookup table, an indexed table, or
elementwise only. Along the activations it follows three things:

* **outputs**: which parameterized layers' outputs reach each activation with no parameterized
  layer in between; a layer whose output reaches the model's prediction outputs and never enters
  another parameterized layer is a *head* (several where the model has several outputs);
* **raw input**: activations computed from the model's inputs alone; a layer reading one is a
  *stem* when its family says so (a lookup, a patchifying or 1-D convolution);
* **splits**: a layer's output cut along its features (``split``, ``chunk``, slices, ``unbind`` or
  ``select`` after ``view(…, k, n/k)``) gives the weight's output blocks (a fused q, k, v or gate,
  up projection).

The model is left as it was: parameters and buffers are stand-ins (meta copies, or for the real
forward the parameters' data under fresh tensors and clones of the buffers), the RNG state is
restored, and no gradient reaches the parameters. A real forward's op that would write to a
parameter's memory in place (a weight clamped inside ``forward``) raises instead, before it
writes: that forward gives no trace. A forward that fails in training mode is tried
again in eval mode (BatchNorm on a pooled 1×1 map refuses one value per channel in training;
eval reads the running statistics instead), the modules' modes restored after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from geomopt.compile.trace.blocks import blocks
from geomopt.compile.trace.dispatch import Tracer
from geomopt.compile.trace.ops import Act, Use
from geomopt.compile.trace.replay import Replayer
from geomopt.compile.wrappers import strip

REPLAY = True  # meta traces replay a model's repeated blocks (geomopt.compile.trace.replay)


@dataclasses.dataclass
class TensorTrace:
    """What the trace saw of one parameter (by its first name)."""

    uses: dict[str, Use] = dataclasses.field(default_factory=dict)  # family → first use
    batched: bool = False  # a matrix operand reached through select / index on its leading dims
    head: Optional[str] = None  # the prediction output it produces ("logits"), when a head
    stem: Optional[str] = None  # "token", "patch", "audio": a stem reading the raw input
    reads_input: bool = False  # a layer reading the model's raw input (a stem or not)
    blocks: Optional[list[int]] = None  # output blocks its layer output is cut into
    batch: int = 0  # leading dims a matmul treats as separate matrices (einsum over a (3, 64, 64) tensor)
    view_ops: tuple[str, ...] = ()  # the ops whose cuts or contraction gave its blocks and batch

    @property
    def reached(self) -> bool:
        return bool(self.uses)


@dataclasses.dataclass
class Trace:
    """The result of :func:`trace_model`: per parameter name, and where it ran."""

    tensors: dict[str, TensorTrace]
    device: str  # "meta", "cpu", "cuda:0"
    outputs: tuple[str, ...]  # the outputs that decided heads
    notes: tuple[str, ...] = ()  # why the meta forward was not used, etc.
    replayed: int = 0  # calls of repeated blocks replayed from a summary (geomopt.compile.trace.replay)


class TraceError(Exception):
    """No trace: the message says why (a lint note and ``explain`` repeat it)."""


# ---------------------------------------------------------------- outputs

# ModelOutput fields that are not predictions: caches, intermediate states, losses
_NOT_PREDICTIONS = ("loss", "past_key_values", "hidden_states", "attentions", "cache_params", "state",
                    "rope_deltas", "router_logits", "aux_loss", "encoder_last_hidden_state", "cross_attentions",
                    "last_hidden_state", "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states",
                    "decoder_attentions", "intermediate_hidden_states", "intermediate_reference_points",
                    "auxiliary_outputs", "image_hidden_states", "init_reference_points")
_STATES = ("last_hidden_state", "pooler_output")


def _outputs(out) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's prediction outputs: every tensor of a plain output; of a
    mapping (a Hugging Face ``ModelOutput``), the fields that are not caches, intermediate states or
    losses — or, for a model with no prediction (a backbone), its final states."""
    if isinstance(out, torch.Tensor):
        return [("output", out)]
    if hasattr(out, "items"):
        items = [(str(k), v) for k, v in out.items()]
        picked = [(k, v) for k, v in items if k not in _NOT_PREDICTIONS and not k.endswith("_hidden_states")]
        if not picked:
            picked = [(k, v) for k, v in items if k in _STATES]
        return [(f"{k}{'' if len(leaves) == 1 else f'[{i}]'}", t) for k, v in picked
                for leaves in [[t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]]
                for i, t in enumerate(leaves)]
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return [(f"output[{i}]", t) for i, t in enumerate(leaves)]


# ---------------------------------------------------------------- running the forward


def _call(model, args, kwargs, values):
    return torch.func.functional_call(model, values, tuple(args), dict(kwargs), strict=False)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _run(model, names: list[list[str]], params: list[torch.Tensor], buffers: dict, args, kwargs, meta: bool):
    """One forward under the tracer; returns (tracer, output); ``tracer.replayed`` counts the
    block calls replayed."""
    if meta:
        stand_ins = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params]
        bufs = {n: torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in buffers.items()}
        args, kwargs = _to_meta(args), _to_meta(kwargs)
    else:
        stand_ins = [p.detach() for p in params]
        bufs = {n: b.clone() for n, b in buffers.items()}  # BatchNorm statistics, caches: untouched
    values: dict[str, Any] = dict(bufs)
    for i, group in enumerate(names):
        for n in group:
            values[n] = stand_ins[i]
    tracer = Tracer(stand_ins, value_free=meta, names=[g[0] for g in names])
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            tracer.acts[leaf] = Act(frozenset(), True, None)
    device = torch.device("meta") if meta else contextlib.nullcontext()
    devices = [] if meta else sorted({p.device for p in params if p.device.type != "cpu"}, key=str)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused kernel hides its matmuls
    replayer = Replayer(tracer, model) if meta and REPLAY else None
    try:
        with torch.random.fork_rng(devices=devices), device, torch.no_grad(), tracer:
            out = _call(model, args, kwargs, values)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        if replayer is not None:
            replayer.uninstall()
            tracer.replayed = replayer.replayed
    return tracer, out


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """The model in eval mode for one forward, each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _distinct(failures: list[tuple[str, str]]) -> list[str]:
    """(where, error) of each failed try, one line per distinct error: the places where the same
    error recurred are named together ("the forward failed on the meta device, on cpu (…)")."""
    by_error: dict[str, list[str]] = {}
    for where, error in failures:
        by_error.setdefault(error, []).append(where)
    return [f"the forward failed {', '.join(wheres)} ({error})" for error, wheres in by_error.items()]


def _error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}{'…' if len(text) > 160 else ''}"


# model → (signature, Trace or TraceError): one trace per model, parameters and input shapes
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _signature(model: torch.nn.Module, named: list, inputs) -> tuple:
    leaves = tree_flatten((inputs.args, inputs.kwargs))[0]
    return (model.training, tuple((n, id(p), tuple(p.shape), p.dtype, p.device) for n, p in named),
            tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else repr(x)[:64]
                  for x in leaves))


def trace_model(model: torch.nn.Module, inputs) -> Trace:
    """Trace one forward of ``model`` on ``inputs`` (an :class:`~geomopt.compile.trace.inputs.Inputs`);
    raises :class:`TraceError` saying why when neither the meta nor the real forward runs. The
    result is kept for the model while its parameters (identity, shape, dtype, device), its
    training mode and the inputs' shapes stay the same."""
    named = list(model.named_parameters(remove_duplicate=False))
    key = _signature(model, named, inputs)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == key:
        if isinstance(hit[1], TraceError):
            raise hit[1]
        return hit[1]
    try:
        result: Any = _trace(model, named, inputs)
    except TraceError as exc:
        result = exc
    _CACHE[model] = (key, result)
    if isinstance(result, TraceError):
        raise result
    return result


def _trace(model: torch.nn.Module, named: list, inputs) -> Trace:
    index: dict[int, int] = {}
    names: list[list[str]] = []
    params: list[torch.Tensor] = []
    for n, p in named:
        if id(p) in index:
            names[index[id(p)]].append(n)
            continue
        index[id(p)] = len(params)
        names.append([n])
        params.append(p)
    if any(type(p).__name__ == "DTensor" or not isinstance(p, torch.Tensor) for p in params):
        raise TraceError("the parameters are distributed (DTensor): roles come from the module tree; trace the "
                         "model before sharding it to check them (geomopt plan --model)")
    buffers = dict(model.named_buffers(remove_duplicate=False))
    failures: list[tuple[str, str]] = []
    places = [True] if all(p.device.type == "meta" for p in params) else [True, False]
    training = any(m.training for m in model.modules())
    tracer = out = None
    for meta, evaluate in [(m, e) for m in places for e in ((False, True) if training else (False,))]:
        try:
            with _eval_mode(model) if evaluate else contextlib.nullcontext():
                tracer, out = _run(model, names, params, buffers, inputs.args, inputs.kwargs, meta)
            break
        except Exception as exc:  # noqa: BLE001 (any failure of user code means: no trace this way)
            where = "on the meta device" if meta else f"on {params[0].device if params else 'cpu'}"
            failures.append((where + (" in eval mode" if evaluate else ""), _error(exc)))
    notes = _distinct(failures)
    if tracer is None:
        raise TraceError("; ".join(notes))
    device = "meta" if meta else str(params[0].device if params else "cpu")
    outputs = _outputs(out)
    heads: dict[int, str] = {}  # weight → the output its layer produces
    for oname, t in outputs:
        act = tracer.acts.get(t)
        for call in (act.src if act is not None else ()):
            if call not in tracer.fed:
                for i in tracer.calls[call]:
                    heads.setdefault(i, oname)
    result = {}
    for i, group in enumerate(names):
        cuts = blocks(tracer.pieces.get(i))
        result[strip(group[0])] = TensorTrace(tracer.uses[i], tracer.batched[i], heads.get(i), tracer.stems[i],
                                              tracer.reads_input[i], cuts, tracer.lead[i], tuple(tracer.view_ops[i]))
    return Trace(result, device, tuple(n for n, _ in outputs), tuple(notes), tracer.replayed)


__all__ = ["Trace", "TensorTrace", "TraceError", "trace_model"]
