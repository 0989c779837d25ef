"""Step programs: how each bucket of tensors steps, chosen once by one dispatcher.

A :class:`Program` names a bucket's stages (direction, forward op, post-stages, decay,
constraint, write-back) and its *variant*: the module function that runs it and the choices that
function reads. :func:`dispatch` is the only place those choices are made, each with the reason it
was made, from what is fixed when the optimizer is built (the plan, the options, the executor, the
tensors' device and dtype) and from the group values the choice reads (the direction and its
form), so a program is built again only when one of those changes (:func:`signature`).

Variants::

    flat      an elementwise rule (φ euclidean, anisotropic, isotropic or adam; no constraint,
              no post-stage): the rule's tensors of one dtype, device and radius run as one call
              of foreach kernels over flat state buffers (optim.engine.flat.step_flat); Adam through
              torch's fused AdamW kernel where the device has one (``fused``)
    batched   every other rule: a bucket's same-shape tensors stacked along a leading dim, one
              call per operator (optim.engine.bucket_step.BucketJob), writing back
              ``one-pass``   X ← lerp(X, S, γλ) with S = −(ρ/λ)∇φ₁*(d) from the forward op
                             (or X += γS, S = −ρ∇φ₁*(d), without decay): one pass over X
              ``in-place``   X ← X(1 − γλ) − γρU with foreach ops on the parameters
              ``stacked``    Y from a stacked float32 copy of X, the prox on Y, then copied back

and, batched, the direction's form (``stacked``: on the stacked gradients; ``rows``: Polyak read
tensor by tensor from the unstacked gradients, no stacked copy of G; ``ahead``: Polyak read ahead
of a deferred finiteness test, its state written after it, or from a capturable step's one selected
copy of G, stacked), the finiteness test (``before`` the
step, or ``deferred`` behind the forward ops' launches, one process; ``device`` when capturable;
``off``, any variant, under ``on_nonfinite: off``: the test never reads the bucket's gradients, so
a NaN reaches parameters and state as in torch), and ``graphed`` (the polynomial forward op
replayed from a CUDA graph).

``compiled`` (``fuse``, one process): the step's elementwise tail runs as functions compiled by
``torch.compile`` (optim.engine.fused): a flat rule's whole step where its map acts on each entry
and its direction is none or Polyak's; a batched bucket's Polyak look-ahead read row by row (d⁺
into a new d and u in one pass) and its in-place write-back X(1 − γλ) − γρU (one pass; with a
constraint whose prox acts entry by entry, proximal_decay, the prox in the same pass, so the write
is ``in-place`` there too); its polynomial iteration takes the folded form on every device
(geometry.polynomial.folded: no pre-normalization pass, no transposed copies); a flat rule's state
kept in a lower precision (not capturable): its codec (each piece's decode, and its encode with
the block scales, code search and random bits), the rule's arithmetic between them eager. A
capturable step's compiled loops select the gradients by the device's finiteness flag themselves
(no selected copy).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.geometry.dtypes import POLYNOMIAL_APPROXES
from geomopt.geometry.forward import elementwise_allocates, input_dtype
from geomopt.optim.units.compensation import step_dtype
from geomopt.geometry.operators import backward_locality, flat_refusal
from geomopt.registry import LOCAL
from geomopt.geometry.polynomial import muon_order
from geomopt.geometry.spectral import APPROX_OPS
from geomopt.optim.units import stages as post_stages
from geomopt.optim.units.decays import DECAYS
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units.state_keys import geometry_state
from geomopt.optim.engine.tensors import FLAT_DTYPES, op_view, upcast

#: device types with a fused AdamW kernel (torch._fused_adamw_)
FUSED_ADAM_DEVICES = ("cpu", "cuda")
#: ``implementation`` values: auto (fused where the device has the kernel), fused, foreach
IMPLEMENTATIONS = ("auto", "fused", "foreach")


@dataclasses.dataclass(frozen=True)
class Options:
    """What the optimizer was built with that programs read."""

    local: bool  # one process (LocalExecutor)
    sharded: bool  # DTensor parameters (FSDP2, HSDP, TP)
    keeps_prev: bool  # some rule is STORM: the step keeps the previous iterate
    track_gap: bool = False
    track_update: bool = False
    cuda_graphs: bool = False
    implementation: str = "auto"
    capturable: bool = False
    fuse: bool = False  # an elementwise rule's flat step compiled whole (optim.engine.fused)


@dataclasses.dataclass(frozen=True)
class Program:
    """A bucket's step. ``group``/``indices``: its param group and the indices of its tensors
    there; ``variant``: ``flat`` or ``batched``; ``write``, ``direction_form``, ``check``,
    ``graphed``, ``fused``: the choices :func:`dispatch` made (see the module), ``why`` the
    reason for each; ``stages`` the step, in order, as text."""

    rule: str
    group: int
    indices: tuple[int, ...]
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    device: str
    variant: str
    stages: tuple[str, ...]
    write: str = ""
    direction_form: str = "stacked"
    check: str = "before"
    graphed: bool = False
    journal: bool = False  # one process: state updated before a request is journaled / put off
    keeps_prev: bool = False
    track_gap: bool = False
    track_update: bool = False
    compiled: bool = False  # the elementwise tail, or an encoded state's codec, compiled (``fuse``: optim.engine.fused)
    product: bool = False  # compiled: the iteration's last product accumulates into X (fused.write_product)
    why: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        """A flat program through torch's fused AdamW kernel."""
        return self.write == "fused"


    def describe(self) -> str:
        shape = f"× {list(self.shape)}" if self.shape or self.variant == "batched" else "tensors of several shapes,"
        head = f"rule {self.rule!r}: {len(self.indices)} {shape} {self.dtype} on {self.device}"
        choices = [self.variant, self.write] + ["compiled"] * self.compiled + ["last product into X"] * self.product
        if self.variant == "batched":
            choices += [f"direction {self.direction_form}", f"check {self.check}"] + ["graphed"] * self.graphed
        elif self.check in ("off", "device"):
            choices.append(f"check {self.check}")
        lines = [head, f"  variant: {' · '.join(choices)}", "  stages: " + " → ".join(self.stages)]
        lines += [f"  why: {w}" for w in self.why]
        names = ", ".join(self.names[:4]) + (f", … ({len(self.names)} tensors)" if len(self.names) > 4 else "")
        lines.append(f"  tensors: {names}")
        return "\n".join(lines)


def signature(group: dict) -> tuple:
    """The group values a program's choices read: a program is built again when they change."""
    return group["direction"], bool(group.get("nesterov")), group.get("init"), group.get("on_nonfinite")


def flat_rule(group: dict, pp: ParamPlan, opts: Options, tensors: Optional[list] = None) -> Optional[str]:
    """None when a rule's whole step is elementwise with nothing that needs its tensors stacked;
    else why not. State kept in a lower precision steps flat where :func:`encoded_flat` allows it
    for the bucket's ``tensors`` (none given: it does not)."""
    not_elementwise = flat_refusal(pp.geometry.kind, opts.sharded)
    if not_elementwise is not None:
        return not_elementwise
    if pp.state_dtype != "float32":
        not_encoded = encoded_flat(pp, opts, tensors or [])
        if not_encoded is not None:
            return f"state {pp.state_dtype}: decoded to float32 and encoded again per bucket ({not_encoded})"
    if pp.constraint is not None:
        return f"constraint {pp.constraint.kind}: its prox runs on the stacked update"
    if pp.post:
        return "post-stages run on the stacked update"
    not_in_place = DECAYS[pp.decay].why_not_in_place()
    if not_in_place is not None:
        return not_in_place
    if not DIRECTIONS[group["direction"]].has("flat"):
        return f"direction {group['direction']} has no list form"
    if opts.track_gap or opts.track_update:
        return "track_gap / track_update measure the stacked step"
    if opts.capturable and not capturable_weights(group, pp, opts):
        return ("capturable: every write selects on the device's finiteness flag, from a stacked copy (a flat "
                "call runs Adam through torch's fused kernel, or Polyak and a map of each entry, weighted by it)")
    return None


def encoded_flat(pp: ParamPlan, opts: Options, tensors: list) -> Optional[str]:
    """None where a rule with state in a lower precision steps flat, chunk by chunk
    (:func:`geomopt.optim.engine.flat.step_flat_encoded`): a map of each entry (isotropic's norms
    read whole tensors, an allocating map the whole call), one process, not capturable, on float32
    contiguous real tensors (``tensors``: as the operators see them; the chunks are flat views of
    them); else why not."""
    if pp.geometry.kind == "isotropic":
        return "isotropic: its norms read whole tensors"
    if pp.geometry.kind == "anisotropic" and elementwise_allocates(pp.geometry):
        return "the map allocates: it runs on the whole call at once"
    if opts.sharded or opts.capturable:
        return "sharded" if opts.sharded else "capturable"
    if not tensors or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return "its chunks are flat views of float32 contiguous tensors"
    return None


def capturable_weights(group: dict, pp: ParamPlan, opts: Options) -> bool:
    """Whether a flat call can skip on the device's flag with no selection: Adam through torch's
    fused kernel (which reads the flag: ``found_inf``), or a ``weighted`` direction (none or Polyak's)
    and a map of each entry, whose writes take the flag as a weight (d.lerp(g, α·ok), X + γ·ok·S, X·(1 − γ·ok·λ):
    on gradients zeroed where it is false, the values as they were)."""
    if pp.geometry.kind == "adam":
        return not DIRECTIONS[group["direction"]].keys and opts.implementation != "foreach"
    # a map of each entry: an elementwise op that needs no norm (LOCAL, as on a shard) and keeps no state
    each_entry = flat_refusal(pp.geometry.kind, sharded=True) is None and not geometry_state(pp.geometry)
    return each_entry and DIRECTIONS[group["direction"]].has("weighted")


def fusable(group: dict, pp: ParamPlan, opts: Options) -> bool:
    """Whether a flat rule's step compiles whole under ``fuse`` (:mod:`geomopt.optim.engine.fused`):
    float32 state (an encoded one steps chunk by chunk), a map of each entry keeping no state (no
    norm: one loop per tensor), a ``weighted`` direction (none or Polyak's: its coefficient α enters
    the graph as a tensor, so a schedule of it compiles nothing again). Capturable too: the compiled loop selects
    the gradients by the device's finiteness flag itself."""
    each_entry = flat_refusal(pp.geometry.kind, sharded=True) is None and not geometry_state(pp.geometry)
    return (opts.fuse and each_entry and DIRECTIONS[group["direction"]].has("weighted")
            and pp.state_dtype == "float32")  # encoded state: its codec compiles instead (codec_fusable)


def codec_fusable(pp: ParamPlan, opts: Options) -> bool:
    """Whether a flat rule's encoded state is decoded and encoded by compiled functions under ``fuse``
    (:func:`geomopt.optim.engine.fused_codec.decode_moment`, :func:`~geomopt.optim.engine.fused_codec.encode_moment`):
    state in a lower precision, stepping flat (:func:`encoded_flat`: one process, not capturable); the
    rule's arithmetic between them stays the float32 state's eager step."""
    return opts.fuse and not opts.capturable and pp.state_dtype != "float32"


def capturable_flat(group: dict, pp: ParamPlan, indices: list, opts: Options) -> Optional[str]:
    """None where a flat call can run a capturable step (:func:`capturable_weights`); Adam's needs
    torch's fused AdamW kernel on the device, which reads the finiteness flag itself
    (``found_inf``: it returns before any write) and lr as a tensor, and contiguous tensors (it
    writes them as flat memory). Else why not (the rule then steps batched)."""
    if not opts.capturable or pp.geometry.kind != "adam":
        return None
    ps = [group["params"][i] for i in indices]
    if ps[0].device.type not in FUSED_ADAM_DEVICES:
        return f"capturable: no fused AdamW kernel on {ps[0].device.type}"
    if not all(p.is_contiguous() for p in ps):
        return "capturable: the fused AdamW kernel needs contiguous parameters"
    return None


def stage_text(group: dict, pp: ParamPlan) -> tuple[str, ...]:
    """The step as text: direction → forward → post-stages → decay → constraint."""
    d = group["direction"]
    if group.get("nesterov"):
        d += " (nesterov)"
    g = pp.geometry
    fwd = g.kind + (f"/{g.approx_kind}" if g.approx is not None else "")
    out = [f"direction {d}", f"forward {fwd}"]
    out += [f"post {s.kind}" for s in pp.post]
    out.append(f"decay {pp.decay}")
    if pp.constraint is not None:
        out.append(f"prox {pp.constraint.kind}")
    return tuple(out)


def dispatch(groups: list, plans: list, buckets: list, opts: Options) -> list[list[Program]]:
    """Per group, the program of each bucket (``buckets[gi]``: lists of indices into the group's
    params, each one plan bucket and one sharding layout). The one place where a step's variant is
    chosen; each choice says why in ``Program.why``."""
    batched: list[tuple[int, int, bool]] = []  # (group, program, deferrable)
    out: list[list[Program]] = []
    for gi, (group, ps, bs) in enumerate(zip(groups, plans, buckets)):
        progs: list[Program] = []
        flat: dict = {}  # (dtype, device) → (common fields, fused, why, indices): one flat call each
        for indices in bs:
            p, pp = group["params"][indices[0]], ps[indices[0]]
            dtype = step_dtype(pp, p.dtype)  # a compensated bf16 parameter steps as its float32 weight
            common = dict(rule=group["rule"], group=gi, indices=tuple(indices),
                          names=tuple(ps[i].name for i in indices), shape=tuple(pp.op_shape), dtype=str(dtype),
                          device=str(p.device), stages=stage_text(group, pp))
            tensors = [op_view(group["params"][i], ps[i]) for i in indices]  # as the flat path reads them
            not_flat = flat_rule(group, pp, opts, tensors) or capturable_flat(group, pp, indices, opts)
            if not_flat is None and dtype in FLAT_DTYPES:
                fused = (pp.geometry.kind == "adam" and opts.implementation != "foreach"
                         and p.device.type in FUSED_ADAM_DEVICES)
                why = ["elementwise rule: the rule's tensors of this dtype and device, whatever their shapes, in one "
                       "foreach call (one per radius and state history)"]
                if pp.geometry.kind == "adam":
                    why.append("torch's fused AdamW kernel (foreach ops for a non-contiguous tensor)" if fused else
                               "Adam with foreach ops (" + ("implementation='foreach'" if opts.implementation
                                                            == "foreach" else f"no fused kernel on {p.device.type}")
                               + ")")
                if fusable(group, pp, opts):
                    why.append("fuse: direction, map, decay and write-back compiled into one loop per tensor "
                               "(torch.compile)")
                if pp.state_dtype != "float32":
                    why.append(f"state {pp.state_dtype}: the moments decoded chunk by chunk into the workspace, "
                               "stepped and encoded back (the float32 copies are one chunk's)")
                if codec_fusable(pp, opts) and pp.geometry.kind == "adam" and not DIRECTIONS[group["direction"]].keys:
                    why.append("fuse: each piece's decode, Adam's arithmetic, write-back, block scales, code "
                               "search, random bits and encode in one compiled call (torch.compile), from the "
                               "second step (the first makes the state as with float32 state)")
                elif codec_fusable(pp, opts):
                    why.append("fuse: each piece's decode, and its block scales, code search, random bits and "
                               "encode, compiled into one kernel per moment (torch.compile); the rule's "
                               "arithmetic between them as with float32 state")
                pooled = flat.setdefault((dtype, p.device), (common, fused, why, []))
                pooled[3].extend(indices)
                continue
            if not_flat is None:
                not_flat = f"{dtype} parameters step in float32 stacked copies"
            prog = _batched(common, group, pp, p, dtype, opts, not_flat)
            progs.append(prog)
            batched.append((gi, len(progs) - 1, _deferrable(prog, group, pp, p)))
        for common, fused, why, indices in flat.values():
            fields = dict(common, indices=tuple(sorted(indices)), names=tuple(ps[i].name for i in sorted(indices)))
            if len({ps[i].op_shape for i in indices}) > 1:
                fields["shape"] = ()  # tensors of several shapes
            if opts.capturable:  # capturable_weights
                fields["check"] = "device"
                why = why + ["capturable: the fused kernel reads the device's finiteness flag (found_inf) and "
                             "returns before any write where it is false" if fused else
                             "capturable: the writes take the device's finiteness flag as a weight (α·ok, γ·ok) "
                             "on gradients zeroed where it is false" + (
                                 " (compiled: selected inside the loop, no copy of G)"
                                 if fusable(group, ps[indices[0]], opts) else "")]
            progs.append(Program(**fields, variant="flat", write="fused" if fused else "foreach",
                                 compiled=(not fused and fusable(group, ps[indices[0]], opts))
                                 or codec_fusable(ps[indices[0]], opts), why=tuple(why)))
        out.append([_unchecked(p) for p in progs] if group["on_nonfinite"] == "off" else progs)
    # the finiteness test waits behind the forward ops' launches only where no bucket of the step
    # writes before its forward op: decided for the optimizer as a whole; not where some rule is
    # off and another tested (a skipped step still steps the off rules' buckets: the host must know
    # before any bucket runs)
    offs = {g["on_nonfinite"] == "off" for g in groups}
    deferred = (opts.local and not opts.keeps_prev and not opts.capturable and all(ok for _, _, ok in batched)
                and offs != {True, False})
    if deferred:
        for gi, k, _ in batched:
            prog = out[gi][k]
            if prog.check == "off":
                continue
            # compiled: the look-ahead writes d⁺ into a new d (nothing live) and its iteration's first
            # Gram matrix gives the test its input's ‖u‖²_F (nonfinite.reads_traces: G is not read for it)
            form = "ahead" if prog.direction_form == "rows" and not prog.compiled else prog.direction_form
            out[gi][k] = dataclasses.replace(
                prog, check="deferred", direction_form=form,
                why=prog.why + ("finiteness test deferred: the host waits for it after launching every forward op "
                                "(no bucket writes before its forward op)" + (
                                    "; fuse: it reads tr A of the iteration's first Gram matrix, ‖u‖²_F, not G"
                                    if prog.compiled and not prog.graphed else ""),))
    return out


def _unchecked(prog: Program) -> Program:
    """``on_nonfinite: off``: the finiteness test skips the program's gradients (torch's behaviour:
    a non-finite gradient propagates into parameters and state)."""
    return dataclasses.replace(prog, check="off", why=prog.why + (
        "on_nonfinite: off: no finiteness test of these gradients (a NaN or ±∞ propagates, as in torch)",))


def _batched(common: dict, group: dict, pp: ParamPlan, p: torch.Tensor, dtype: torch.dtype, opts: Options,
             not_flat: str) -> Program:
    why = [f"batched: {not_flat}"]
    if dtype != p.dtype:
        why.append(f"{p.dtype} parameters with compensation {pp.compensation}: the step runs on their float32 "
                   f"weights (bf16 + the error kept as state)")
    kind = pp.geometry.kind
    working = dtype == upcast(torch.empty((), dtype=dtype)).dtype
    reasons = {"a constraint's prox needs Y": pp.constraint is not None, "adam geometry": kind == "adam",
               "track_update measures X⁺ − X": opts.track_update, f"{pp.decay} decay": DECAYS[pp.decay].reads_step,
               f"{dtype} parameters (float32 working copy)": not working}
    stacked = [r for r, on in reasons.items() if on]
    constraint = pp.constraint
    fused_prox = (opts.fuse and opts.local and constraint is not None
                  and stacked == ["a constraint's prox needs Y"] and backward_locality(kind, constraint.kind) == LOCAL)
    if fused_prox and constraint is not None:  # an entrywise prox needs no Y: compiled into the in-place write-back
        write = "in-place"
        why.append(f"in-place: the {constraint.kind} prox acts entry by entry, compiled into the write-back "
                   f"(X ← prox(X(1 − γλ) − γρU))")
    elif stacked:
        write = "stacked"
        why.append("write-back from a stacked copy: " + ", ".join(stacked))
    elif pp.post or muon_order(p.device) or not opts.local:
        write = "in-place"
        why.append("in-place foreach update: " + ("post-stages follow the forward op" if pp.post else
                   "torch.optim.Muon's op order on this device" if muon_order(p.device) else
                   "executors exchange results in the input's dtype"))
    else:
        write = "one-pass"
        why.append("one pass: the forward op folds −ρ/λ (or −ρ) into its output, then one lerp (or axpy) on X")
    form = "stacked"
    unit = DIRECTIONS[group["direction"]]
    if unit.has("rows") and not opts.keeps_prev and dtype in (torch.float32, torch.float64):
        form = "rows"
        why.append(f"{unit.name} read row by row from the unstacked gradients (no stacked copy of G)")
    compiled = opts.fuse and opts.local and (write == "in-place" or form == "rows")
    if compiled:
        why.append("fuse: " + " and ".join(
            (["the look-ahead read row by row in one pass"] if form == "rows" else [])
            + (["the in-place write-back in one pass over X"] if write == "in-place" else [])) + " (torch.compile)")
        if pp.post and post_stages.row_dims(list(pp.post), post_stages.Context({}, pp.op_shape, pp.geometry.view)):
            why.append("fuse: the post-stages by rows (one read of U; their factor per row applied by the write-back)")
    approx = pp.geometry.approx_kind
    graphed = opts.cuda_graphs and approx in POLYNOMIAL_APPROXES and opts.local and p.device.type == "cuda"
    if graphed:
        why.append(f"cuda_graphs: the {approx} iteration replays from a CUDA graph")
    # fuse: X ← X(1 − γλ) − γρ·F·Xₖ by the iteration's last product itself (addmm's β and α), where
    # nothing comes between the forward op and the write (no post-stage, constraint or view), the
    # decay only scales X and the iteration runs in X's dtype (addmm_ takes one: a bf16 iteration's
    # result is cast first); a host-read γ (not capturable) and no CUDA graph (it replays the whole op)
    product = (compiled and write == "in-place" and constraint is None and not pp.post and not opts.capturable
               and not graphed and DECAYS[pp.decay].scales and pp.geometry.view is None and kind == "spectral"
               and APPROX_OPS.meta.get(approx, {}).get("folds", False) and input_dtype(pp.geometry, p) == dtype)
    if product:
        why.append(f"fuse: the {approx} iteration's last product accumulates into X (X(1 − γλ) − γρ·F·Xₖ: the "
                   "product's β and α), so its result is never written and read back")
    journal = opts.local
    check = "before"
    if opts.capturable:
        check = "device"
        if form == "rows" and not compiled:  # one selected copy of G, stacked: what the rows' eager ops read
            form = "ahead"
            why.append("capturable: Polyak read ahead from the gradients selected once into a stacked copy (eager "
                       "ops turn 0·NaN into NaN), d written at the commit")
        why.append("capturable: the finiteness flag stays on the device; a skipped step selects the old values"
                   + ("" if write == "stacked" else " (the parameters: γ·flag, so X is written as X·1 + 0·S)"))
    return Program(**common, variant="batched", write=write, direction_form=form, check=check, graphed=graphed,
                   journal=journal, keeps_prev=opts.keeps_prev,
                   track_gap=opts.track_gap, track_update=opts.track_update, compiled=compiled, product=product,
                   why=tuple(why))


def _deferrable(prog: Program, group: dict, pp: ParamPlan, p: torch.Tensor) -> bool:
    """A batched bucket that writes nothing before its forward op: direction none, or Polyak read
    from the unstacked gradients; no Adam geometry or cautious decay (post-stages run after the
    forward op's answer, so after the barrier, and their state is journaled); off torch Muon's
    op order (on CPU the step keeps its order), or compiled (``fuse`` gives that order up) with a
    polynomial iteration (which takes non-finite input without raising, as an SVD would not)."""
    return ((not DIRECTIONS[group["direction"]].keys or prog.direction_form == "rows") and pp.geometry.kind != "adam"
            and DECAYS[pp.decay].in_place is not None
            and (not muon_order(p.device) or (prog.compiled and pp.geometry.approx_kind in POLYNOMIAL_APPROXES)))


def reads_gradient(pp: ParamPlan) -> bool:
    """Whether the rule's post-stages read the raw gradient (kept before the direction)."""
    return bool(pp.post) and "gradient" in post_stages.reads(list(pp.post))
