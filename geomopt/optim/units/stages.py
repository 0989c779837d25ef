"""Post-stages: what a rule does to the geometry's update U = ∇φ₁*(D) before weight decay and the
constraint (one step is direction → geometry → post-stages → weight decay → constraint).

Each stage is a registered unit ``fn(u, cfg, ctx) -> u`` on a bucket's stacked update (leading
dim = tensor index), with the state it keeps, what it reads besides U, and its locality for the
distributed executors (:mod:`geomopt.distributed`): ``local`` stages act entry by entry,
``reduce`` stages need a sum over each tensor (or over its rows / columns). A bucket's stages run
as one request where its data is (DDP: every rank holds whole tensors; FSDP2: each rank its
shards), and a ``reduce`` stage's sums over a dim cut across ranks are all-reduced by
:meth:`Context.sum`, the same collectives in the same order on every rank. Stages run in
:data:`geomopt.spec.updates.STAGE_ORDER`, at most once each, after the forward op and with ρ = 1:
the rule's radius ρ multiplies their result, so a stage shapes the unit update and ρ still sets
the step. Every stage computes in float32 at least (the forward op's output dtype).

A stage whose result is F⊙U, F a function of U's per-row sums of squares, declares that
*statistics form* (``rows``: ss → F; ``by_rows``: for which fragments and tensors): a chain of them
is one factor from one read of U (:func:`row_factor`), which ``fuse=True`` folds into its
write-back (:mod:`geomopt.optim.engine.fused`); both forms call the stage's one arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from geomopt.geometry.reference import working_eps
from geomopt.compile.fragments import View
from geomopt.geometry.view import count, matrix_shapes
from geomopt.optim.units.declare import COUNT, SECOND, STAT, StateKey, declare
from geomopt.registry import LOCAL, REDUCE, Registry

#: the per-parameter step count of the stages (a count tensor, like ``adam_step``)
STAGE_STEP = "post_step"


@dataclasses.dataclass(frozen=True)
class Stage:
    fn: Callable
    state: tuple[str, ...]
    reads: tuple[str, ...]  # "gradient", "direction", "param", "input_norm" besides U
    locality: Callable[[dict], str]  # cfg → locality
    rows: Optional[Callable] = None  # the statistics form: (ss, cfg, ctx) → F, U ← F⊙U (see the module)
    by_rows: Callable[[Any, "Context"], bool] = lambda cfg, ctx: False  # where ``rows`` is the stage


STAGES = Registry("post-stage")


def stage(kind: str, *, state: tuple = (), reads: tuple = (), locality: Callable[[dict], str] = lambda cfg: REDUCE,
          rows: Optional[Callable] = None, by_rows: Callable = lambda cfg, ctx: True):
    """Register ``fn`` as the post-stage ``kind`` with the state it keeps (:class:`StateKey`
    entries, declared under the state kind ``kind`` with the stages' step count), what it reads,
    its locality (a function of the stage's spec fragment) and its statistics form ``rows`` where
    it has one (for the fragments and tensors ``by_rows`` says)."""

    def register(fn):
        if state:
            declare(kind, *state, StateKey(STAGE_STEP, layout=COUNT))
        STAGES.add(kind, Stage(fn, tuple(k.key for k in state), reads, locality, rows,
                               by_rows if rows is not None else Stage.by_rows))
        return fn

    return register


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where a bucket's stacked update is cut across ranks (FSDP2, HSDP, FSDP2 × TP): ``block``: per
    dim of one tensor, this rank's (start, size); ``cuts``: per dim, the mesh dims that cut it
    (a dim cut by none is whole here); ``mesh``: the device mesh whose groups sum over them."""

    block: tuple
    cuts: tuple
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh


@dataclasses.dataclass
class Context:
    """What a bucket's stages read besides U: the stacked state (created on first use), the raw
    gradient, the direction and the parameters X before the step (operators' layout, float32 at
    least; each only where a stage reads it), the Frobenius norm of U as
    the geometry gave it (per tensor), the stages' step number, the tensor's op shape and view,
    and, for sharded tensors (:class:`Shard`), where the stack is cut: sums over a cut dim are
    all-reduced (:meth:`sum`), so every rank normalizes its shard by the whole tensor's
    statistics. ``reduced``: per state key, the dims of the stack its statistic sums out (its
    entries are then replicated over the mesh dims that cut those dims). ``fresh``: a stage puts
    its updated state in ``state`` as a new tensor rather than writing the old one in place, so the
    optimizer's state changes only when the bucket commits (:mod:`geomopt.optim.engine.atomic`)."""

    state: dict
    op_shape: tuple[int, ...]
    view: Optional[View] = None
    gradient: Optional[torch.Tensor] = None
    direction: Optional[torch.Tensor] = None
    param: Optional[torch.Tensor] = None
    input_norm: Optional[torch.Tensor] = None
    step: int = 1
    shard: Optional[Shard] = None
    reduced: dict = dataclasses.field(default_factory=dict)
    fresh: bool = False

    def _mesh_dims(self, dims) -> list:
        if self.shard is None:
            return []
        return sorted({m for d in dims for m in self.shard.cuts[d - 1]})

    def cut(self, dims) -> bool:
        return bool(self._mesh_dims(dims))

    def across(self, partial: torch.Tensor, dims) -> torch.Tensor:
        """``partial``, a sum over ``dims`` of this rank's entries, summed over the ranks where one
        of ``dims`` is cut across them (in place; one all-reduce per mesh dim that cuts them,
        never over a replicating one); as it is otherwise."""
        mesh_dims = self._mesh_dims(dims)
        if mesh_dims:
            mesh = self.shard.mesh  # type: ignore[union-attr]  # mesh dims exist only with a shard
            for m in mesh_dims:
                dist.all_reduce(partial, group=mesh.get_group(m))
        return partial

    def sum(self, t: torch.Tensor, dims) -> torch.Tensor:
        """Σ over ``dims`` (kept), over the whole tensor where a dim is cut across ranks; no dims
        (a stack of 0-d tensors): each entry is its own sum (torch reads ``dim=()`` as every dim)."""
        if not dims:
            return t.clone()
        return self.across(t.sum(dim=tuple(dims), keepdim=True), dims)

    def mean(self, t: torch.Tensor, dims) -> torch.Tensor:
        if not dims:
            return t.clone()
        if not self.cut(dims):
            return t.mean(dim=tuple(dims), keepdim=True)
        full = (len(t), *self.op_shape)
        return self.sum(t, dims) / math.prod(full[d] for d in dims)

    def norm(self, u: torch.Tensor) -> torch.Tensor:
        """‖U‖_F per tensor, shaped to broadcast against the stack (|U| for 0-d tensors)."""
        if u.ndim == 1:
            return u.abs()
        if not self.cut(_dims(u)):
            return torch.linalg.vector_norm(u, dim=_dims(u), keepdim=True)
        return self.sum(u * u, _dims(u)).sqrt_()

    def rows(self, dim: int, device) -> torch.Tensor:
        """The whole tensor's indices along ``dim`` of this rank's entries."""
        if self.shard is not None:
            start, size = self.shard.block[dim - 1]
            return torch.arange(start, start + size, device=device)
        return torch.arange(self.op_shape[dim - 1], device=device)


def _dims(u: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, u.ndim))


def _matrix_axes(ctx: Context) -> tuple[int, tuple[int, ...], Optional[tuple[int, ...]]]:
    """(row dim, column dims, row blocks) of the tensor's matrices in the stacked update (dim 0 is
    the tensor index): the geometry's view where it has one (experts: rows of each expert; a
    conv kernel: out × in·kh·kw, or one out × in matrix per position with ``trailing: batch``),
    else the (shape[0], rest) matrix."""
    view, ndim = ctx.view, len(ctx.op_shape)
    if view is None:
        return 1, tuple(range(2, ndim + 1)), None
    b = view.batch
    row = b + 1
    cols = (row + 1,) if view.trailing == "batch" else tuple(range(row + 1, ndim + 1))
    return row, cols, view.blocks


def _power_normalized(d: torch.Tensor, ctx: Context, steps: int, eps: float = 1e-10) -> torch.Tensor:
    """Each matrix of ``d`` (each row block of a view on its own) divided by its σ₁ estimated by
    ``steps`` power iterations from the all-ones vector: w ← Dv/‖·‖, v ← Dᵀw/‖·‖, σ₁ ≈ ‖Dv‖ (norms
    floored at ``eps``). Products as sums over rows or columns (:meth:`Context.sum`), so a matrix cut
    across ranks is estimated whole."""
    _, cols, _ = _matrix_axes(ctx)
    if not cols:  # a vector, one n × 1 matrix: σ₁ is its norm
        return d / ctx.norm(d).clamp_(min=eps)

    def per_row(t):  # Σ over each row's columns
        return _per_axis(t, ctx, "row", mean=False)[0]

    def per_column(t):  # Σ over each column's rows, per row block
        return _per_axis(t, ctx, "column", mean=False)[0]

    stat, _, expand = _per_axis(d, ctx, "column", mean=False)

    def to_rows(t):  # a per-block statistic back on the block's rows
        return t.index_select(*expand) if expand is not None else t

    v = torch.full_like(stat, 1 / math.sqrt(math.prod(ctx.op_shape[c - 1] for c in cols)))
    for _ in range(steps):
        w = per_row(d * to_rows(v))
        w = w / to_rows(per_column(w * w).sqrt_().clamp_(min=eps))
        v = per_column(d * w)
        v = v / ctx.sum(v * v, cols).sqrt_().clamp_(min=eps)
    w = per_row(d * to_rows(v))
    return d / to_rows(per_column(w * w).sqrt_().clamp_(min=eps))


@stage("contra", reads=("direction",))
def contra(u, cfg, ctx):
    """U ← (1 + c)·U − c·D/σ₁(D) per matrix of the tensor's view, D the direction the geometry was
    given (the momentum), σ₁ by ``power_steps`` power iterations from the all-ones vector: Contra-Muon
    (Nilin 2026, github.com/nilin/contra-muon; first used in modded-nanogpt PR #275, whose code
    subtracts CONTRA_MUON/2 of the operator-normalized momentum and restores ‖U‖_F: c/(1 + c) =
    CONTRA_MUON/2, then ``rms_match`` target input), which damps the top singular directions
    relative to Muon; no state."""
    c = cfg["coeff"]
    return (1 + c) * u - c * _power_normalized(ctx.direction.to(u.dtype), ctx, cfg["power_steps"])


def _longer(ctx: Context) -> str:
    """``row`` where the tensor's (first) matrix has at least as many rows as columns, else ``column``."""
    m, n = matrix_shapes(ctx.view, ctx.op_shape)[0]
    return "row" if m >= n else "column"


def _per_axis(sq: torch.Tensor, ctx: Context, axis: str, mean: bool):
    """The mean (``mean``) or sum of ``sq`` over each row (``axis: row``) or column (``column``) of
    the tensor's matrices, each row block of a view on its own: (statistic, the dims it sums over,
    the (dim, index) that expands a per-block statistic back to the rows, or None)."""
    reduce = ctx.mean if mean else ctx.sum
    if axis == "row":
        _, reduced, _ = _matrix_axes(ctx)
        return (reduce(sq, reduced) if reduced else sq), reduced, None
    row, _, blocks = _matrix_axes(ctx)
    sizes = blocks or [ctx.op_shape[row - 1]]
    if len(sizes) == 1:
        return reduce(sq, (row,)), (row,), None
    # per row block: each block's rows summed into its own entry (then / its size for a mean)
    block = torch.bucketize(ctx.rows(row, sq.device), torch.tensor(sizes, device=sq.device).cumsum(0), right=True)
    shape = list(sq.shape)
    shape[row] = len(sizes)
    stat = ctx.across(sq.new_zeros(shape).index_add_(row, block, sq), (row,))
    if mean:
        count = [1] * sq.ndim
        count[row] = len(sizes)
        stat = stat / torch.tensor(sizes, dtype=sq.dtype, device=sq.device).reshape(count)
    return stat, (row,), (row, block)


def _moment_denom(m2: torch.Tensor, reduced: tuple, cfg, ctx: Context) -> torch.Tensor:
    """second_moment's arithmetic on its statistic m2 = mean(U²) (summed over ``reduced``):
    v ← β₂v + (1−β₂)·m2 (``post_v``, starting at 0), and the divisor √(v/c) + ε of U."""
    ctx.reduced["post_v"] = reduced  # replicated over the mesh dims that cut these
    v = ctx.state.get("post_v")
    if v is None:
        v = ctx.state["post_v"] = torch.zeros_like(m2)
    if ctx.fresh:  # the same lerp into m2 (a temporary of v's shape): no new memory
        v = ctx.state["post_v"] = torch.lerp(v, m2, 1 - cfg["beta2"], out=m2)
    else:
        v.lerp_(m2, 1 - cfg["beta2"])
    eps = working_eps(cfg["eps"], v.dtype, norm=True)  # a square root of squares: floored at √tiny, as Adam's
    # (c = 1 when β₂ = 0, where v/c is v: the same bits either way; the step may be a device tensor)
    t = ctx.step.to(torch.float64) if isinstance(ctx.step, torch.Tensor) else ctx.step  # (a device count: float64)
    return (v / (1 - cfg["beta2"] ** t)).sqrt_().add_(eps) if cfg["bias_correction"] else v.sqrt().add_(eps)


def _moment_axis(cfg, ctx: Context) -> str:
    return _longer(ctx) if cfg["axis"] == "longer" else cfg["axis"]


def _moment_rows(ss: torch.Tensor, cfg, ctx: Context) -> torch.Tensor:
    """second_moment by rows: m2 = ss/n (n columns), F = 1/(√(v/c) + ε) per row."""
    _, cols, _ = _matrix_axes(ctx)
    return _moment_denom(ss / math.prod(ctx.op_shape[c - 1] for c in cols), cols, cfg, ctx).reciprocal_()


@stage("second_moment", state=(StateKey("post_v", layout=STAT, moment=SECOND),),
       locality=lambda cfg: LOCAL if cfg["axis"] == "element" else REDUCE,
       rows=_moment_rows, by_rows=lambda cfg, ctx: _moment_axis(cfg, ctx) == "row")
def second_moment(u, cfg, ctx):
    """v ← β₂v + (1−β₂)·mean(U²) over each row (``axis: row``: NorMuon, Li et al. 2025, Alg. 1),
    each column (``column``; each row block of a view on its own), each row or column of the longer
    side (``longer``: rows where m ≥ n, else columns; modded-nanogpt's NorMuonH, track 3 record
    20260430_normuonh) or per entry (``element``: AdaMuon, Si et al. 2025, Alg. 1);
    U ← U/(√(v/c) + ε), c = 1 − β₂ᵗ with ``bias_correction`` (AdaMuon) else 1 (NorMuon). v starts
    at 0 and is kept per tensor (``post_v``)."""
    sq = u * u
    axis = _moment_axis(cfg, ctx)
    if axis == "element":
        m2, reduced, expand = sq, (), None
    else:
        m2, reduced, expand = _per_axis(sq, ctx, axis, mean=True)
    denom = _moment_denom(m2, reduced, cfg, ctx)
    if expand is not None:
        denom = denom.index_select(*expand)
    return u / denom


@stage("axis_norm")
def axis_norm(u, cfg, ctx):
    """U ← U/√(Σ U² + ε) over each row or column of the tensor's matrices (each row block of a view
    on its own), in ``order``: Muon+ (Zhang et al. 2026, arXiv:2602.21545; the authors' code,
    github.com/K1seki221/MuonPlus, ``apply_post_polar_norm``: ε = 1e-7 inside the square root),
    which normalizes the orthogonalized update's rows, columns, or both in turn; no state."""
    for axis in cfg["order"]:
        ss, _, expand = _per_axis(u * u, ctx, axis, mean=False)
        denom = ss.add_(cfg["eps"]).sqrt_()
        u = u / (denom.index_select(*expand) if expand is not None else denom)
    return u


@stage("dual_scale", reads=("direction",))
def dual_scale(u, cfg, ctx):
    """U ← ⟨U, D⟩·U per tensor. For the exact lmo U = lmo(D) of a norm ‖·‖, ⟨U, D⟩ = ‖D‖_*, so
    the step is ‖D‖_*·lmo(D), steepest descent in ‖·‖ (Kelner et al. 2014; Bernstein & Newhouse
    2024); with the spectral geometry it is PolarGrad's nuclear-norm-scaled polar step (Lau, Long &
    Su 2025: X ← X − γ·tr(H)·U_p for D = U_p·H)."""
    return u * ctx.sum(u * ctx.direction, _dims(u))


@stage("norm_ratio", state=(StateKey("post_g2", layout=STAT, moment=SECOND),), reads=("gradient", "direction"))
def norm_ratio(u, cfg, ctx):
    """U ← U·‖D‖_F/(√v + ε), v ← β₂v + (1−β₂)·‖G‖²_F per tensor (v⁰ = 0, no bias correction; D the
    direction the geometry was given, G the raw gradient): NAMO, norm-adaptive Muon (arXiv:2602.17080,
    2026), as NVIDIA Emerging-Optimizers' ``AdaptiveMuon(moment2_method="namo")`` computes it: the
    orthogonalized momentum scaled by how large the momentum is against the gradients' running RMS
    (``post_g2``, one number per tensor)."""
    dims = _dims(u)
    g2 = ctx.sum(ctx.gradient * ctx.gradient, dims)
    ctx.reduced["post_g2"] = dims
    v = ctx.state.get("post_g2")
    if v is None:
        v = ctx.state["post_g2"] = torch.zeros_like(g2)
    if ctx.fresh:
        v = ctx.state["post_g2"] = torch.lerp(v, g2, 1 - cfg["beta2"])
    else:
        v.lerp_(g2, 1 - cfg["beta2"])
    eps = working_eps(cfg["eps"], v.dtype, norm=True)
    return u * (ctx.norm(ctx.direction) / (v.sqrt() + eps))


def _polar_norm(ctx: Context) -> float:
    """‖Q‖_F of a semi-orthogonal Q with the tensor's matrices: √Σ min(m_i, n_i)."""
    shapes = matrix_shapes(ctx.view, ctx.op_shape)
    per = count(ctx.view, ctx.op_shape) // len(shapes) if ctx.view is not None else 1
    return math.sqrt(per * sum(min(m, n) for m, n in shapes))


def _rms_factor(norm: torch.Tensor, cfg, ctx: Context) -> torch.Tensor:
    """rms_match's factor T/(‖U‖_F + ε) on U, from ‖U‖_F per tensor."""
    target = cfg["target"]
    scale: Any
    if target == "input":
        scale = ctx.input_norm
    elif target == "unit":
        scale = 1.0
    elif target == "polar":
        scale = _polar_norm(ctx)
    else:
        scale = float(target) * math.sqrt(math.prod(ctx.op_shape))
    return scale / (norm + working_eps(cfg["eps"], norm.dtype, norm=True))


@stage("rms_match", reads=("input_norm",),
       rows=lambda ss, cfg, ctx: _rms_factor(ss.sum(dim=_dims(ss), keepdim=True).sqrt_(), cfg, ctx))
def rms_match(u, cfg, ctx):
    """U ← U·T/(‖U‖_F + ε) per tensor of n entries: T = t·√n for a number t (RMS t; 0.2 is
    Moonlight's AdamW-matched scale, Liu et al. 2025, and NorMuon's ``match_rms``), the norm U had
    when the geometry gave it for ``input`` (NorMuon's official ``preserve_norm``), or √Σmin(m, n)
    over the tensor's matrices for ``polar``, the norm of a semi-orthogonal matrix (AdaMuon), or 1
    for ``unit``: the rule's radius ρ then sets ‖step‖_F (hyperball Muon, NVIDIA Emerging-Optimizers'
    ``MuonHyperball``, 2025: W ← R·normalize(W − lr·R·normalize(U))). By rows: ‖U‖²_F = Σ_i ss_i."""
    return u * _rms_factor(ctx.norm(u), cfg, ctx)


@stage("cautious", reads=("gradient",))
def cautious(u, cfg, ctx):
    """U ← U⊙m·n/(Σm + 1), m = [U⊙G > 0] per tensor of n entries (Cautious optimizers, Liang et al.
    2024, as their code and pytorch-optimizer apply it): components whose sign disagrees with the
    gradient G are dropped and the rest scaled up by about the fraction dropped."""
    mask = (u * ctx.gradient > 0).to(u.dtype)
    n = math.prod(ctx.op_shape)
    return u * mask * (n / (ctx.sum(mask, _dims(u)) + 1))


@stage("trust_ratio", reads=("param",))
def trust_ratio(u, cfg, ctx):
    """U ← r·W, W = U + λX, r = η·min(‖X‖_F, c)/(N + ε), per tensor, X the parameter before the
    step; r = 1 where ‖X‖ = 0 or N = 0 (both references' guard); no state. ``denominator: sum``:
    N = ‖U‖_F + λ‖X‖_F, LARS (You, Gitman & Ginsburg 2017, arXiv:1708.03888, Alg. 1: local lr
    η‖w‖/(‖∇L‖ + β‖w‖) on ∇L + βw; pytorch-optimizer's ``LARS``, ε = 0); ``update``: N = ‖W‖_F,
    LAMB (You et al. 2020, arXiv:1904.00962, Alg. 2: r = m/(√v + ε) + λx scaled by φ(‖x‖)/‖r‖, φ
    the identity, or min(·, 10) in the authors' and pytorch-optimizer's ``Lamb``, whose ratio is
    ‖x‖/(‖r‖ + ε)). λ = ``weight_decay`` is the papers' coupled decay, inside W and the ratio: both
    optimizers are then exact as specs with the rule's decoupled decay at 0 (decay after the
    stages, X(1 − γλ), would scale X outside the ratio, which neither paper does). η·r is read
    per tensor, so it is a layer's step relative to its weight."""
    x = ctx.param.to(u.dtype)
    lam, eps = cfg["weight_decay"], cfg["eps"]
    x_norm = ctx.norm(x)
    if lam:
        w = torch.add(u, x, alpha=lam)  # (the references' op: g.add_(x, alpha=λ))
        n = ctx.norm(u) + lam * x_norm if cfg["denominator"] == "sum" else ctx.norm(w)
    else:
        w, n = u, ctx.norm(u)
    if cfg["clamp"] is not None:
        x_norm = x_norm.clamp(max=cfg["clamp"])
    r = torch.where((x_norm > 0) & (n > 0), cfg["coeff"] * x_norm / (n + eps), torch.ones_like(n))
    return w * r


def reads(post) -> set:
    """What the stages ``post`` (spec models) read besides the update."""
    return {r for s in post for r in STAGES[s.kind].reads}


def row_dims(post: list, ctx: Context) -> Optional[tuple[int, ...]]:
    """The dims of the stack (its matrices' columns) whose sums of U² give the stages ``post``
    their statistics, where every one has a statistics form for this tensor (``Stage.by_rows``);
    None where one has not, or where the tensor is cut across ranks (its stages sum across the
    shards, :meth:`Context.sum`: they run as written)."""
    _, cols, _ = _matrix_axes(ctx)
    by_rows = ctx.shard is None and bool(cols) and all(STAGES[c.kind].by_rows(c, ctx) for c in post)
    return cols if by_rows else None


def row_factor(ss: torch.Tensor, post: list, ctx: Context) -> torch.Tensor:
    """The stages ``post`` (:func:`row_dims` not None) as one factor F, U ← F⊙U, from
    ss = Σ_j U²_ij (per row, float32 at least), with their state updated as their units say: a
    stage's factor f comes from its input's ss, and its result's is ss·f² (‖U‖²_F = Σ_i ss_i
    for ``input_norm``); so U is read once for every stage's statistics."""
    if "input_norm" in reads(post):
        ctx.input_norm = ss.sum(dim=_dims(ss), keepdim=True).sqrt_()
    factor: Any = None
    for cfg in post:
        f = STAGES[cfg.kind].rows(ss, cfg, ctx)
        ss = ss * (f * f)
        factor = f if factor is None else factor * f
    return factor


def run(u: torch.Tensor, post: list, ctx: Context) -> torch.Tensor:
    """The rule's post-stages on the stacked update ``u`` (in their spec order), in float32 at
    least: a polynomial iteration run in bfloat16 (its ``dtype``) gives a bf16 ``u``, which the
    stages' float32 state (``post_v``) could not meet in one op."""
    u = u.to(torch.promote_types(u.dtype, torch.float32))
    if "input_norm" in reads(post):
        ctx.input_norm = ctx.norm(u)
    for cfg in post:
        u = STAGES[cfg.kind].fn(u, cfg, ctx)
    return u

