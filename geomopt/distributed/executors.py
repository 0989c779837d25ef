"""Where each operator runs under ``torch.distributed`` (docs: guide/distributed.md).

A step asks for its operators through *requests* (:class:`Request`): the stacked input of a
bucket and the operator to apply. An executor answers them, and every rank answers the same
requests in the same order, so collectives line up without any handshake:

* :class:`LocalExecutor` (one process): applies the operator.
* :class:`ReplicatedExecutor` (DDP: every rank holds every tensor): requests of the ``owner``
  class (matrix functions: Newton–Schulz, SVD, polar, top-k) are split by matrix across ranks by
  a balanced split of their FLOPs (longest job first onto the least loaded rank); each rank
  computes its matrices (still batched per bucket) and one ``all_gather`` per round and dtype
  shares the results, as distributed Muon does. Elementwise and norm-based operators stay local.
* :class:`ShardedExecutor` (DTensor parameters: FSDP2, HSDP, FSDP2 or HSDP × TP, experts under
  expert parallelism, on meshes of any dims; :mod:`.layout` says which block of each tensor every
  rank holds): ``local`` operators
  act on the local blocks; ``reduce`` operators (Frobenius / ℓ2 norms of isotropic steps and
  balls, row and column norms) run on DTensors, so torch reduces over the mesh; ``owner``
  operators gather each matrix on its owning rank (any rank of the mesh, balanced by FLOPs) with
  one ``all_to_all`` per round, each block from one rank that holds it, compute there and send
  every rank its block back with a second ``all_to_all`` (the layout microsoft/dion uses).

The locality of every operator (``LOCAL``, ``REDUCE``, ``OWNER``: :mod:`geomopt.registry`) is
declared where it registers (:mod:`geomopt.geometry.operators`: ``forward_locality``,
``backward_locality``); the caller puts it on each request.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
import torch.distributed as dist

from geomopt.distributed.layout import layouts
from geomopt.registry import LOCAL, OWNER, REDUCE

if TYPE_CHECKING:
    from geomopt.distributed.layout import Layout


@dataclass
class Request:
    """Apply ``fn`` to ``x`` (leading dim = tensor index; rows are independent).

    ``fn(x) -> (out, flags)``: ``out`` has x's shape, ``flags`` is a bool tensor (rows,) or None.
    ``layout``: where each rank's block of one row lies (:class:`~geomopt.distributed.layout.Layout`,
    in the operators' view; None when every rank holds the whole input).
    ``full_shape``: shape of one row of the unsharded input. ``cost``: the FLOPs of one row when
    its matrix view is not the (shape[0], rest) matrix (experts, blocks: the view's sum; of the
    local matrices where they are ``whole``). ``whole``: an owner request whose matrices each lie
    whole on every rank (only their batch dims are cut: experts under FSDP2), which every rank
    computes on its own blocks. ``owners``: an owner request's rank for each row, fixed where the
    operator keeps state with each matrix (it must run where that state lies, every step); ``fn``
    is then called as ``fn(x, rows)``, ``rows`` the indices of the request's rows that ``x`` holds."""

    fn: Callable
    x: torch.Tensor
    locality: str
    layout: Optional[Layout] = None
    full_shape: tuple = ()
    whole: bool = False
    cost: Optional[float] = None
    owners: Optional[tuple] = None

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def row_cost(self) -> float:
        """FLOPs of a matrix function of one row (:func:`matrix_cost`)."""
        return matrix_cost(self.full_shape or tuple(self.x.shape[1:]), self.cost)


def matrix_cost(shape: tuple, cost: Optional[float] = None) -> float:
    """FLOPs of a matrix function of a tensor of ``shape``, up to a constant: m·n·min(m, n) of its
    (shape[0], rest) matrix; ``cost`` where its view says otherwise (the sum over its matrices)."""
    if cost is not None:
        return cost
    m = shape[0] if shape else 1
    n = math.prod(shape[1:]) if len(shape) > 1 else 1
    return float(m) * n * min(m, n)


@dataclass
class WorkCounter:
    """Matrix-function work done by this rank (rows = matrices, flops = Σ m·n·min(m, n),
    seconds = host time spent computing them: on an asynchronous device, dispatch time only)."""

    rows: int = 0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, req: "Request", rows: int) -> None:
        self.rows += rows
        self.flops += rows * req.row_cost()

    def reset(self) -> None:
        self.rows, self.flops, self.seconds = 0, 0.0, 0.0

    def timed(self, fn, *args):
        if torch.compiler.is_compiling():  # no host clock inside a compiled graph
            return fn(*args)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def assign(costs: list[float], world: int) -> list[int]:
    """Owner rank per job: longest first onto the least-loaded rank (ties: lowest rank, then
    original order); deterministic, so every rank computes the same assignment."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda q: (load[q], q))
        owners[j] = r
        load[r] += costs[j]
    return owners


def _apply(req: Request, x: torch.Tensor, rows: Optional[list] = None):
    """``req``'s operator on ``x``, the rows ``rows`` of the request (all of them where None)."""
    out, flags = req.fn(x) if req.owners is None else req.fn(x, list(range(req.rows)) if rows is None else rows)
    if flags is None:
        flags = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    return out, flags


class LocalExecutor:
    """One process: apply every request where it is."""

    world, rank = 1, 0

    def __init__(self):
        self.work = WorkCounter()

    def run(self, requests: list[Request]) -> list:
        out = []
        for req in requests:
            if req.locality == OWNER:
                self.work.add(req, req.rows)
                out.append(self.work.timed(_apply, req, req.x) if req.owners is not None
                           else self.work.timed(req.fn, req.x))
            else:
                out.append(req.fn(req.x))
        return out

    def all_finite(self, flags: torch.Tensor) -> torch.Tensor:
        return flags


class _DistExecutor:
    def __init__(self, group=None):
        self.dist = dist
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.work = WorkCounter()

    def all_finite(self, flags: torch.Tensor) -> torch.Tensor:
        """Per-job finiteness, AND-ed over ranks (a shard elsewhere may be the non-finite one), so
        every rank skips or raises alike."""
        t = flags.to(torch.int32)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.group)
        return t.bool()

    def _owners(self, requests: list[Request]) -> list[list[int]]:
        """Owner of each row of each owner-class request: its fixed owner where the request names one
        (state kept with the matrix), else one balanced split for the round."""
        jobs = [(i, r) for i, req in enumerate(requests) if req.locality == OWNER and not req.whole
                and req.owners is None for r in range(req.rows)]
        costs = [requests[i].row_cost() for i, _ in jobs]
        out = [[-1] * req.rows for req in requests]
        for (i, r), o in zip(jobs, assign(costs, self.world)):
            out[i][r] = o
        for i, req in enumerate(requests):
            if req.locality == OWNER and req.owners is not None:
                out[i] = list(req.owners)
        return out


class ReplicatedExecutor(_DistExecutor):
    """DDP: inputs are whole on every rank. Owner-class requests: each rank computes its rows,
    then one all_gather per dtype shares outputs and flags."""

    def run(self, requests: list[Request]) -> list:
        owners = self._owners(requests)
        results: list = [None] * len(requests)
        mine: list = [None] * len(requests)
        for i, req in enumerate(requests):
            if req.locality != OWNER:
                results[i] = req.fn(req.x)
                continue
            rows = [r for r in range(req.rows) if owners[i][r] == self.rank]
            if rows:
                self.work.add(req, len(rows))
                idx = torch.tensor(rows, device=req.x.device)
                mine[i] = (rows, *self.work.timed(_apply, req, req.x.index_select(0, idx), rows))
        by_dtype: dict = {}
        for i, req in enumerate(requests):
            if req.locality == OWNER:
                by_dtype.setdefault(req.x.dtype, []).append(i)
        for dtype, idxs in by_dtype.items():
            self._exchange(requests, owners, mine, results, idxs, dtype)
        return results

    def _exchange(self, requests, owners, mine, results, idxs, dtype) -> None:
        device = requests[idxs[0]].x.device
        row_numel = {i: requests[i].x[0].numel() + 1 for i in idxs}  # + the fallback flag
        sizes = [sum(row_numel[i] for i in idxs for r in range(requests[i].rows) if owners[i][r] == q)
                 for q in range(self.world)]
        parts = []
        for i in idxs:
            if mine[i] is not None:
                _, out, flags = mine[i]
                parts.append(torch.cat([out.reshape(out.shape[0], -1).to(dtype), flags.to(dtype).unsqueeze(1)], 1)
                             .reshape(-1))
        size = max(sizes)
        buf = torch.zeros(size, dtype=dtype, device=device)
        if parts:
            flat = torch.cat(parts)
            buf[: flat.numel()] = flat
        gathered = [torch.empty_like(buf) for _ in range(self.world)]
        self.dist.all_gather(gathered, buf, group=self.group)
        cursor = [0] * self.world
        for i in idxs:
            req = requests[i]
            out = torch.empty_like(req.x)
            flags = torch.zeros(req.rows, dtype=torch.bool, device=device)
            for r in range(req.rows):
                q = owners[i][r]
                seg = gathered[q][cursor[q]: cursor[q] + row_numel[i]]
                cursor[q] += row_numel[i]
                out[r].copy_(seg[:-1].reshape(out[r].shape))
                flags[r] = seg[-1] != 0
            results[i] = (out, flags)


class ShardedExecutor(_DistExecutor):
    """FSDP2, HSDP, FSDP2 × TP: inputs are local blocks of DTensors (:mod:`.layout`). ``reduce``
    requests run on DTensors (torch reduces the norms over the mesh); ``owner`` requests gather
    each matrix on its owner (one all_to_all over the group per round: each block from one rank
    that holds it, the owner itself where it does), compute there and send every rank its block
    back (a second all_to_all)."""

    def __init__(self, group, params: list, names: list):
        super().__init__(group)
        self.layouts = dict(zip(map(id, params), layouts(params, names, group, self.dist)))

    def run(self, requests: list[Request]) -> list:
        results: list = [None] * len(requests)
        for i, req in enumerate(requests):
            if req.locality == LOCAL:
                results[i] = req.fn(req.x)
            elif req.locality == REDUCE:
                try:
                    results[i] = self._on_dtensor(req)
                except RuntimeError as err:
                    # DTensor cannot flatten a dim cut unevenly (a vocabulary over 8 ranks, fewer rows
                    # than ranks) into the (B, n) reading some operators take: every rank fails alike
                    # (sharding propagation is metadata), so every rank computes it as a matrix
                    # function instead, gathered whole on one owner
                    if "unevenly sharded" not in str(err):
                        raise
                    requests[i] = replace(req, locality=OWNER)
            elif req.whole:  # each rank's matrices are whole: computed where they are (if it holds any)
                if req.x.numel() == 0:
                    results[i] = (req.x.clone(), torch.zeros(req.rows, dtype=torch.bool, device=req.x.device))
                    continue
                self.work.add(req, req.rows)
                results[i] = self.work.timed(_apply, req, req.x)
        owners = self._owners(requests)
        by_dtype: dict = {}
        for i, req in enumerate(requests):
            if req.locality == OWNER and not req.whole:
                by_dtype.setdefault(req.x.dtype, []).append(i)
        for dtype, idxs in by_dtype.items():
            self._owner_round(requests, owners, results, idxs, dtype)
        return results

    def _on_dtensor(self, req: Request):
        from torch.distributed.tensor import DTensor  # DTensor's package loads only where tensors are sharded

        layout = cast("Layout", req.layout)  # requests on DTensors carry their layout
        shape = (req.rows, *req.full_shape)
        placements = layout.stacked_placements()
        x = DTensor.from_local(req.x, layout.mesh, placements, run_check=False, shape=torch.Size(shape),
                               stride=contiguous_strides(shape))
        out, flags = req.fn(x)
        if tuple(out.placements) != placements:
            out = out.redistribute(layout.mesh, placements)
        if isinstance(flags, DTensor):
            flags = flags.full_tensor()
        return out.to_local(), flags

    def _owner_round(self, requests, owners, results, idxs, dtype) -> None:
        world, me = self.world, self.rank
        device = requests[idxs[0]].x.device
        lay = {i: cast("Layout", requests[i].layout) for i in idxs}

        def owned(i: int, q: int) -> list:
            return [r for r in range(requests[i].rows) if owners[i][r] == q]

        # 1. one holder of each block sends it to the row's owner (the owner itself where it holds one)
        send, send_sizes = [], []
        for q in range(world):
            parts = [requests[i].x[r].reshape(-1) for i in idxs if lay[i].sends(me, q) for r in owned(i, q)]
            send_sizes.append(sum(p.numel() for p in parts))
            send += parts
        recv_sizes = [sum(lay[i].numel(s) * len(owned(i, me)) for i in idxs if lay[i].sends(s, me))
                      for s in range(world)]
        received = self._all_to_all(send, send_sizes, recv_sizes, dtype, device)
        # 2. the owner places the blocks in the whole matrix and computes its rows
        offsets = [sum(recv_sizes[:s]) for s in range(world)]
        computed: dict = {}
        for i in idxs:
            req, rows = requests[i], owned(i, me)
            if not rows:
                continue
            full = req.x.new_empty((len(rows), *req.full_shape))
            for k in range(len(rows)):
                for s in range(world):
                    if lay[i].sends(s, me):
                        n = lay[i].numel(s)
                        piece = received[offsets[s]: offsets[s] + n]
                        full[k][lay[i].slices(s)] = piece.reshape([m for _, m in lay[i].blocks[s]])
                        offsets[s] += n
            self.work.add(req, len(rows))
            out, flags = self.work.timed(_apply, req, full, rows)
            computed[i] = dict(zip(rows, zip(out.unbind(0), flags.unbind(0))))
        # 3. the owner sends every rank its block of the result (and the fallback flag)
        send, send_sizes = [], []
        for q in range(world):
            parts = []
            for i in idxs:
                for r in owned(i, me):
                    out, flag = computed[i][r]
                    parts += [out[lay[i].slices(q)].reshape(-1).to(dtype), flag.to(dtype).reshape(1)]
            send_sizes.append(sum(p.numel() for p in parts))
            send += parts
        recv_sizes = [sum((lay[i].numel(me) + 1) * len(owned(i, s)) for i in idxs) for s in range(world)]
        received = self._all_to_all(send, send_sizes, recv_sizes, dtype, device)
        offsets = [sum(recv_sizes[:s]) for s in range(world)]
        for i in idxs:
            req = requests[i]
            out = torch.empty_like(req.x)
            flags = torch.zeros(req.rows, dtype=torch.bool, device=device)
            n = req.x[0].numel()
            for r in range(req.rows):
                s = owners[i][r]
                seg = received[offsets[s]: offsets[s] + n + 1]
                offsets[s] += n + 1
                out[r].copy_(seg[:-1].reshape(out[r].shape))
                flags[r] = seg[-1] != 0
            results[i] = (out, flags)

    def _all_to_all(self, parts, send_sizes, recv_sizes, dtype, device) -> torch.Tensor:
        send = torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        self.dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        return recv


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def make_executor(params: list, distributed, process_group, names: Optional[list] = None) -> object:
    """The executor for these parameters: ``distributed`` False → local; "auto" (default) →
    sharded if any parameter is a DTensor, replicated if torch.distributed is initialized with
    more than one rank, else local; "ddp" / "fsdp" force the mode (and fail clearly when the
    parameters do not fit it)."""
    dtensor = [is_dtensor(p) for p in params]
    if distributed is False or distributed == "none":
        if any(dtensor):
            raise ValueError("parameters are DTensors (FSDP2): GeomOptimizer needs distributed='auto' or 'fsdp' "
                             "for them")
        return LocalExecutor()
    if distributed not in ("auto", "ddp", "fsdp", True):
        raise ValueError(f"distributed must be 'auto', 'ddp', 'fsdp' or False, not {distributed!r}")
    if any(dtensor):
        if not all(dtensor):
            raise ValueError("some parameters are DTensors and some are not: shard the whole model with fully_shard "
                             "(or none of it)")
        if distributed == "ddp":
            raise ValueError("distributed='ddp' expects replicated (plain) parameters, but they are DTensors (FSDP2)")
        names = names or [f"parameter {i}" for i in range(len(params))]
        return ShardedExecutor(_mesh_group(params, process_group), params, names)
    if distributed == "fsdp":
        raise ValueError("distributed='fsdp' expects DTensor parameters: call torch.distributed.fsdp.fully_shard on "
                         "the model before building the optimizer")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        return ReplicatedExecutor(process_group)
    if distributed == "ddp":
        raise ValueError("distributed='ddp' needs torch.distributed initialized (init_process_group) with > 1 rank")
    return LocalExecutor()


def is_dtensor(t) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor  # DTensor's package loads only where tensors are sharded
    except ImportError:  # torch built without distributed
        return None
    return DTensor


_DTENSOR = _dtensor_class()  # looked up once: is_dtensor runs per tensor per step


def _mesh_group(params: list, process_group):
    """The process group a sharded step communicates over: ``process_group`` when given; else the
    mesh's ranks when every parameter lives on one mesh (its group on a 1-D mesh, the whole
    world or a group of its ranks on a 2-D one); else (parameters on sub-meshes of a larger mesh,
    as FSDP2 × TP leaves norms and embeddings) the whole world."""
    if process_group is not None:
        group = process_group
    else:
        meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in params}
        if len(meshes) > 1:
            group = None
        else:
            mesh = params[0].device_mesh
            ranks = sorted(next(iter(meshes)))
            if mesh.ndim == 1:
                group = mesh.get_group()
            elif len(ranks) == dist.get_world_size():
                group = None
            else:
                group = dist.new_group(ranks, use_local_synchronization=True)
    members = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for p in params:
        outside = set(p.device_mesh.mesh.flatten().tolist()) - members
        if outside:
            raise ValueError(f"a DTensor parameter's mesh has rank(s) {sorted(outside)} outside the optimizer's "
                             f"process group {sorted(members)}: pass process_group= covering the whole mesh")
    return group
