"""Where each rank's shard of a DTensor parameter lies in the whole tensor (docs: guide/distributed.md).

A DTensor's placements say how its mesh cuts it: ``Shard(d)`` splits dim d across a mesh dim
(torch.chunk sizes), ``Replicate()`` copies it, and FSDP2 on top of tensor parallelism writes
``_StridedShard(d, split_factor=k)`` for its own cut of a dim that tensor parallelism (the later
mesh dim, of size k) has already split. Every placement geomopt serves leaves each rank one
contiguous block of the tensor, a range per dim (:func:`block`):

* Meshes of any number of dims with ``Replicate`` and ``Shard`` in any combination: FSDP2
  (``Shard(0)``), HSDP (``(Replicate(), Shard(0))``), FSDP2 × TP row-wise (``(Shard(0), Shard(1))``),
  HSDP × TP on a 3-D (replicate, shard, tp) mesh (``(Replicate(), Shard(0), Shard(1))``), experts
  under expert parallelism (``Shard(0)`` of the expert dim on the ep mesh dim), and FSDP2's
  ``(_StridedShard(d, k), Shard(d))`` over a TP (or EP) ``Shard(d)`` of the same dim, on any
  mesh dims, with ``Replicate`` around them (HSDP × TP column-wise:
  ``(Replicate(), _StridedShard(0, k), Shard(0))``): TP's chunks first, then FSDP2's chunk of each.
* ``Partial`` (a pending sum) and other nestings of ``_StridedShard`` are refused at construction
  with the parameter's name and placements (:func:`check`); so is any layout whose shards do not
  tile the tensor exactly once.

:class:`Layout` holds the blocks of every rank of the optimizer's process group (exchanged once,
at construction) so the owner of a matrix knows which piece to ask each rank for, and which
ranks hold the same block (replicas: one sends, the owner's own copy where it has one; all
receive the result).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

Block = tuple  # ((start, size) per dim)


class LayoutError(ValueError):
    """A DTensor placement or mesh geomopt cannot serve."""


SUPPORTED = ("supported: Replicate or Shard on each mesh dim of a mesh of any number of dims (FSDP2, HSDP, FSDP2 or "
             "HSDP × tensor parallel, expert parallel), including FSDP2's _StridedShard(d, split_factor=k) over a "
             "later Shard(d) of the same dim on a mesh dim of size k")


def _chunk(start: int, size: int, parts: int, k: int) -> tuple:
    """Piece k of ``parts`` of the range (start, size), torch.chunk sizes (as DTensor's Shard)."""
    step = -(-size // parts) if size else 0
    lo = min(k * step, size)
    return start + lo, max(0, min(step, size - lo))


def block(shape, mesh_shape, coord, placements, name: str = "tensor") -> Block:
    """The (start, size) per dim of the block that mesh coordinate ``coord`` holds of a tensor of
    ``shape`` laid out by ``placements`` (:func:`check` lists what is served)."""
    # DTensor's package loads only where tensors are sharded
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ranges = [(0, n) for n in shape]
    cuts: dict = {}
    for i, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, (Shard, _StridedShard)):
            raise LayoutError(f"'{name}' has placements {tuple(placements)}: {type(pl).__name__} on mesh dim {i} "
                              f"cannot be served ({SUPPORTED})")
        cuts.setdefault(pl.dim % len(shape), []).append(i)
    for d, dims in cuts.items():
        kinds = [type(placements[i]) for i in dims]
        order = dims
        if any(k is _StridedShard for k in kinds):
            # FSDP2 over TP: (_StridedShard on mesh dim i, split_factor = mesh size of j) then Shard
            # on a later mesh dim j of the same tensor dim: TP's chunk first, then FSDP2's
            ok = (len(dims) == 2 and kinds == [_StridedShard, Shard]
                  and placements[dims[0]].split_factor == mesh_shape[dims[1]])
            if not ok:
                raise LayoutError(f"'{name}' has placements {tuple(placements)}: this nesting of _StridedShard "
                                  f"cannot be served ({SUPPORTED})")
            order = [dims[1], dims[0]]
        for i in order:
            ranges[d] = _chunk(ranges[d][0], ranges[d][1], mesh_shape[i], coord[i])
    return tuple(ranges)


def check(name: str, p) -> None:
    """Refuse a DTensor parameter whose mesh or placements geomopt cannot serve, saying which
    parameter, its placements and what is supported."""
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    mine = block(tuple(p.shape), tuple(mesh.shape), coord, p.placements, name)
    local = tuple(p.to_local().shape)
    if tuple(n for _, n in mine) != local:
        raise LayoutError(f"'{name}' with placements {tuple(p.placements)} holds a local shard of shape {local} "
                          f"where geomopt expects {tuple(n for _, n in mine)} ({SUPPORTED})")


@dataclass(frozen=True)
class Layout:
    """The blocks of one parameter over the ranks of a process group: ``blocks[q]`` is group rank
    q's block; ``rank`` is this process's group rank; ``mesh``, ``placements``: this rank's
    DTensor's (for operators that run on DTensors); ``cuts``: per dim, the mesh dims that cut it."""

    blocks: tuple
    rank: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple
    cuts: tuple
    holders: tuple = field(init=False, repr=False)  # per rank: the ranks holding its block
    numels: tuple = field(init=False, repr=False)

    def __post_init__(self):
        # looked up per row and rank in every owner round: computed once
        first: dict = {}
        for q, b in enumerate(self.blocks):
            first.setdefault(b, []).append(q)
        object.__setattr__(self, "holders", tuple(tuple(first[b]) for b in self.blocks))
        object.__setattr__(self, "numels", tuple(_volume(b) for b in self.blocks))

    def mine(self) -> Block:
        return self.blocks[self.rank]

    def numel(self, q: int) -> int:
        return self.numels[q]

    def primary(self, q: int) -> bool:
        """Whether rank q holds the first copy of its block (the lowest rank holding it; an empty
        block is nobody's): what counts a block once over replicas."""
        return self.numels[q] > 0 and self.holders[q][0] == q

    def sends(self, q: int, owner: int) -> bool:
        """Whether rank q sends its block to ``owner`` to assemble a matrix there: the owner's own
        copy where it holds one (nothing crosses the network), else one of the block's holders,
        picked by the owner's rank so that replicas share the sending."""
        if self.numels[q] == 0:
            return False
        holders = self.holders[q]
        return q == (owner if owner in holders else holders[owner % len(holders)])

    def slices(self, q: int) -> tuple:
        return tuple(slice(s, s + n) for s, n in self.blocks[q])

    def transposed(self) -> "Layout":
        """The layout of the transpose of dims 0 and 1 (the operators' view under ``layout: in_out``)."""

        def swap(t: tuple) -> tuple:
            return (t[1], t[0], *t[2:]) if len(t) > 1 else t

        from torch.distributed.tensor import Replicate  # DTensor's package loads only where tensors are sharded

        nd = len(self.blocks[0])
        placements = tuple(pl if isinstance(pl, Replicate) else _with_dim(pl, _swapped(pl.dim % nd))
                           for pl in self.placements)
        return Layout(tuple(swap(b) for b in self.blocks), self.rank, self.mesh, placements, swap(self.cuts))

    def stacked_placements(self) -> tuple:
        """The placements of a stack of such tensors along a new leading dim."""
        from torch.distributed.tensor import Replicate  # DTensor's package loads only where tensors are sharded

        nd = len(self.blocks[0])
        return tuple(pl if isinstance(pl, Replicate) else _with_dim(pl, pl.dim % nd + 1) for pl in self.placements)

    def statistic_placements(self, reduced: tuple) -> tuple:
        """The placements of a statistic of the tensor (same dims, ``reduced`` dims summed out):
        cut like the tensor along the dims it keeps, replicated over the mesh dims that cut a
        summed-out dim (after the all-reduce every rank there holds the same values)."""
        from torch.distributed.tensor import Replicate  # DTensor's package loads only where tensors are sharded

        nd = len(self.blocks[0])
        return tuple(Replicate() if isinstance(pl, Replicate) or pl.dim % nd in reduced else pl
                     for pl in self.placements)


def _swapped(d: int) -> int:
    return 1 - d if d < 2 else d


def _with_dim(pl, dim: int):
    # DTensor's package loads only where tensors are sharded
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(pl, _StridedShard):
        return _StridedShard(dim, split_factor=pl.split_factor)
    return Shard(dim)


def layouts(params: list, names: list, group, dist) -> list:
    """The :class:`Layout` of every parameter: each rank computes its own blocks and one
    ``all_gather_object`` over ``group`` shares them."""
    mine = []
    for p, name in zip(params, names):
        check(name, p)
        mine.append(block(tuple(p.shape), tuple(p.device_mesh.shape), p.device_mesh.get_coordinate(), p.placements,
                          name))
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    rank = dist.get_rank(group)
    out = []
    for j, (p, name) in enumerate(zip(params, names)):
        blocks = tuple(gathered[q][j] for q in range(world))
        _tiles(name, p, blocks)
        nd = p.ndim
        cuts = tuple(tuple(i for i, pl in enumerate(p.placements) if getattr(pl, "dim", None) is not None
                           and pl.dim % nd == d) for d in range(nd))
        out.append(Layout(blocks, rank, p.device_mesh, tuple(p.placements), cuts))
    return out


def _tiles(name: str, p, blocks: tuple) -> None:
    """The distinct blocks cover the tensor exactly once (else the layout is not one geomopt
    understands: refuse rather than compute on a wrong matrix)."""
    distinct = sorted(set(b for b in blocks if all(n for _, n in b)))
    total = sum(_volume(b) for b in distinct)
    overlap = any(_meets(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
    if total != p.numel() or overlap:
        raise LayoutError(f"'{name}' with placements {tuple(p.placements)}: the ranks' shards do not tile the "
                          f"tensor ({SUPPORTED})")


def _volume(b: Block) -> int:
    out = 1
    for _, n in b:
        out *= n
    return out


def _meets(a: Block, b: Block) -> bool:
    return all(sa < sb + nb and sb < sa + na for (sa, na), (sb, nb) in zip(a, b))


def whole_matrices(view: Optional[dict], cuts: tuple) -> bool:
    """Whether every matrix of a tensor's ``view`` lies whole on each rank: the dims cut across
    ranks (``cuts``, the operators' layout) only index matrices (an expert's, a kernel position's),
    never their rows or columns. Then a matrix function runs on each rank's own matrices, with no
    gather (:class:`~geomopt.distributed.executors.ShardedExecutor`)."""
    cut = {d for d, mesh_dims in enumerate(cuts) if mesh_dims}
    if view is None or not cut:
        return False
    b = view["batch"]
    batch = set(range(b)) | (set(range(b + 2, len(cuts))) if view["trailing"] == "batch" else set())
    return cut <= batch


def layout_key(p) -> Optional[tuple]:
    """What a bucket's tensors must share to stack their shards: the mesh's ranks and the placements."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return None
    return tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), tuple(p.placements)
