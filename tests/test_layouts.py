"""The same update at every layout: one process, DDP ×2, FSDP2 ×2, HSDP 2×2 and FSDP2 × TP 2×2 on 4
CPU processes (gloo), for every shipped spec and two specs that cover every operator locality and
every post-stage, on an HF Llama built from a config.

One ``torchrun --nproc_per_node 4 tests/layout_worker.py`` run (module fixture) does the training;
the tests read what each rank saved. Single-process units of the layout arithmetic run here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("layout_worker.py")
sys.path.insert(0, str(WORKER.parent))
import layout_worker as worker  # noqa: E402

from geomopt.distributed.layout import Layout, LayoutError, block  # noqa: E402
from refusals import REFUSED_ON_SHARDS  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

#: max over tensors of ‖X − X_ref‖_F / ‖X_ref‖_F after the worker's steps (DDP: bit for bit). The
#: shards sum their norms and statistics in another order than one process (and TP splits the
#: forward's matmuls), which rounding amplifies by at most ~5e-6 here
BOUND = 2e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return worker.launch(4, tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def reference(ranks):
    return worker.merged(ranks, "ref")


def deviation(got: dict, ref: dict) -> float:
    return max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref)


def test_the_worker_covers_every_shipped_spec(reference):
    from geomopt import shipped_specs

    assert set(reference) == set(shipped_specs()) | {"mixed", "staged", "shampoo-bf16-factors"}


@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_ddp_is_bit_identical_to_one_process(ranks, reference, name):
    got, ref = ranks[0]["ddp"][name], reference[name]["params"]
    assert all(torch.equal(got[k], ref[k]) for k in ref), name


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp_tp"])
@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_sharded_layouts_match_one_process(ranks, reference, layout, name):
    refused = ranks[0].get("refused", {}).get(layout, {})
    if name in refused:  # a rule of this spec refuses sharded tensors on this model: its refusal, saying why
        assert REFUSED_ON_SHARDS.get(name, "(not expected to refuse)") in refused[name], (layout, refused[name])
        return
    ref = reference[name]["params"]
    got = ranks[0][layout][name]
    assert deviation(got, ref) <= BOUND, (layout, name, deviation(got, ref))
    # and the run moved the weights (a layout that skipped its steps would match only the start)
    start = worker.make_model().state_dict()
    assert any(not torch.equal(got[k], start[k]) for k in ref)


def test_the_layouts_are_what_they_claim(ranks):
    r = ranks[0]
    assert r["executor"] == dict(ddp="ReplicatedExecutor", fsdp="ShardedExecutor", hsdp="ShardedExecutor",
                                 fsdp_tp="ShardedExecutor")
    hsdp, tp = r["placements"]["hsdp"], r["placements"]["fsdp_tp"]
    assert hsdp["model.layers.0.self_attn.q_proj.weight"] == "(Replicate(), Shard(dim=0))"
    # column-wise TP under FSDP2: TP's Shard(0), FSDP2's strided cut of each TP chunk
    assert tp["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert tp["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"  # row-wise
    assert tp["model.norm.weight"] == "(Shard(dim=0),)"  # FSDP2 only, on the dp sub-mesh


@pytest.mark.parametrize("layout,share", [("ddp", 2), ("fsdp", 2), ("hsdp", 4), ("fsdp_tp", 4)])
def test_matrix_work_is_balanced_over_the_ranks(ranks, reference, layout, share):
    """Each rank computes about 1/share of the matrix functions (FLOPs): a DDP pair or FSDP2 group
    splits them in two, the 2 × 2 meshes over all four ranks."""
    for name in ("muon", "mixed", "staged"):
        total = reference[name]["flops"]
        for r in ranks:
            assert r["work"][layout][name] == pytest.approx(total / share, rel=0.35), (layout, name)
        assert sum(r["work"][layout][name] for r in ranks) == pytest.approx(total * 4 / share, rel=1e-9)


def test_experts_cut_whole_are_computed_where_they_are(ranks):
    """FSDP2 cuts a (5, 12, 8) expert weight into 3 + 2 whole experts: each rank orthogonalizes its
    own (its FLOPs are its experts' share: no rank gathers the tensor), and the update matches one
    process; under HSDP the replicas compute their copies alike; over 4 ranks (2 + 2 + 1 + 0) the
    last holds none and computes nothing."""
    for r in ranks:
        e = r["experts"]
        shares = dict(fsdp=[3, 2, 3, 2][r["rank"]], hsdp=[3, 2, 3, 2][r["rank"]], fsdp4=[2, 2, 1, 0][r["rank"]])
        for layout, share in shares.items():
            assert e[layout]["max_rel"] <= BOUND, (layout, e[layout])
            assert e[layout]["flops"] == pytest.approx(e["ref_flops"] * share / 5, rel=1e-9, abs=1e-9), (layout, e)


@pytest.mark.parametrize("key", [("hsdp", "staged"), ("hsdp", "mixed"), ("fsdp_tp", "staged"),
                                 ("fsdp_tp", "mixed")])
def test_state_dict_and_dcp_round_trips_are_exact(ranks, key):
    for r in ranks:
        got = r["round_trips"][key]
        assert got == dict(state_dict=True, dcp=True, dtensor_state=True, placed_like_params=True), (key, got)


@pytest.mark.parametrize("name", ["soap", "shampoo", "psgd-kron"])
def test_kronecker_state_on_owners_resumes_bit_for_bit(ranks, name):
    """FSDP2 × TP: the kronecker state each matrix's owner keeps (plain tensors, on that rank alone)
    goes through opt.state_dict() and through DCP, and the runs resume bit for bit."""
    for r in ranks:
        got = r["round_trips"][("fsdp_tp", name)]
        assert got["state_dict"] and got["dcp"], (name, got)


def test_kronecker_state_lies_on_one_owner_per_matrix(ranks):
    """FSDP2 × TP (one group of 4 ranks): each matrix's factors, bases and moments are on exactly one
    rank, the owners share them out (no rank holds more than twice its share of the bytes)."""
    held = [r["owned"]["held"] for r in ranks]
    names = set(held[0])
    assert names and all(set(h) == names for h in held)
    assert all(sum(h[n] for h in held) == 1 for n in names), held
    sizes = [r["owned"]["bytes"] for r in ranks]
    assert all(0 < b <= 2 * sum(sizes) / len(sizes) for b in sizes), sizes


def test_unservable_meshes_and_placements_are_refused(ranks):
    for r in ranks:
        e = r["errors"]
        assert e["partial"] and "'blocks.0.w'" in e["partial"] and "Partial" in e["partial"]
        assert "supported:" in e["partial"]
        assert e["strided"] and "'blocks.0.w3'" in e["strided"] and "_StridedShard" in e["strided"]
        assert "supported:" in e["strided"]
        assert e["mesh_change"] and "torch.distributed.checkpoint" in e["mesh_change"]
        assert "2x2 (Replicate(), Shard(dim=0))" in e["mesh_change"]
        # the kronecker state each matrix's owner keeps: float32 only, and each rank's own
        assert e["kron_bf16"] and "kronecker geometry with state: bfloat16" in e["kron_bf16"], e["kron_bf16"]
        assert "set state: float32" in e["kron_bf16"]
        assert e["kron_other_rank"] and "kept by the rank that owns the tensor's matrix" in e["kron_other_rank"]
        assert "load each rank's own optimizer.state_dict()" in e["kron_other_rank"]


def test_update_norms_count_each_block_once(ranks):
    """diagnostics()' update norm (track_update) under HSDP (replicas) and FSDP2 × TP equals one
    process's, per rule: a replica's block counted twice would read √2 too large."""
    for r in ranks:
        d = r["diagnostics"]
        for layout in ("hsdp", "fsdp_tp"):
            assert d[layout].keys() == d["ref"].keys()
            for rule, norm in d["ref"].items():
                assert d[layout][rule] == pytest.approx(norm, rel=1e-4), (layout, rule)


def test_a_nonfinite_gradient_in_one_tp_block_skips_the_step_everywhere(ranks):
    for r in ranks:
        assert r["nonfinite"]["unchanged"]
        assert r["nonfinite"]["skipped"]["hidden"] == 1
    assert len({str(r["nonfinite"]["skipped"]) for r in ranks}) == 1


# ---------------------------------------------------------------- single-process units


def _placements(*names):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for n in names:
        if n == "R":
            out.append(Replicate())
        elif n.startswith("SS"):
            out.append(_StridedShard(int(n[2]), split_factor=int(n[4])))
        else:
            out.append(Shard(int(n[1])))
    return tuple(out)


@pytest.mark.parametrize("n,world", [(10, 2), (7, 4), (3, 4), (0, 2), (97, 2)])
def test_a_shard_is_torch_chunk(n, world):
    x = torch.arange(n)
    pieces = torch.chunk(x, world) if n else []
    for k in range(world):
        (start, size), = block((n,), (world,), (k,), _placements("S0"))
        want = pieces[k].tolist() if k < len(pieces) else []
        assert list(range(start, start + size)) == want


@pytest.mark.parametrize("rows", [10, 11, 9, 4])
def test_fsdp_over_column_tp_cuts_tp_chunks_first(rows):
    """(_StridedShard(0, 2), Shard(0)) on a (dp=2, tp=2) mesh: rank (i, j) holds FSDP2's chunk i of
    TP's chunk j (torch.chunk at both levels), as FSDP2 lays it out."""
    x = torch.arange(rows)
    for i in range(2):
        for j in range(2):
            tp = torch.chunk(x, 2)[j]
            parts = torch.chunk(tp, 2)
            want = parts[i].tolist() if i < len(parts) else []
            (start, size), = block((rows,), (2, 2), (i, j), _placements("SS0,2", "S0"))
            assert list(range(start, start + size)) == want


def test_hsdp_and_row_tp_blocks():
    assert block((8, 6), (2, 2), (1, 0), _placements("R", "S0")) == ((0, 4), (0, 6))
    assert block((8, 6), (2, 2), (1, 1), _placements("S0", "S1")) == ((4, 4), (3, 3))
    assert block((8, 6), (2, 2), (1, 1), _placements("S0", "S0")) == ((6, 2), (0, 6))  # left to right


def test_unservable_placements_name_the_tensor():
    from torch.distributed.tensor import Partial

    with pytest.raises(LayoutError, match="'w' has placements.*Partial.*supported"):
        block((4, 4), (2,), (0,), (Partial(),), "w")
    with pytest.raises(LayoutError, match="nesting of _StridedShard"):
        block((8,), (2, 2), (0, 0), _placements("S0", "SS0,2"), "w")


def test_layout_views_and_replicas():
    blocks = (((0, 4), (0, 6)), ((4, 4), (0, 6)), ((0, 4), (0, 6)), ((4, 4), (0, 6)))  # HSDP: ranks 2, 3 replicas
    lay = Layout(blocks, 2, None, _placements("R", "S0"), ((1,), ()))
    assert [lay.primary(q) for q in range(4)] == [True, True, False, False]
    # the owner's own copy where it has one, else the holder its rank picks: each block exactly once
    assert [q for q in range(4) if lay.sends(q, 2)] == [1, 2]
    assert [q for q in range(4) if lay.sends(q, 3)] == [2, 3]
    assert [q for q in range(4) if lay.sends(q, 0)] == [0, 1]
    for owner in range(4):
        assert sorted(blocks[q] for q in range(4) if lay.sends(q, owner)) == sorted(set(blocks))
    assert lay.slices(1) == (slice(4, 8), slice(0, 6)) and lay.numel(3) == 24
    t = lay.transposed()
    assert t.blocks[1] == ((0, 6), (4, 4)) and t.cuts == ((), (1,)) and repr(t.placements[1]) == "Shard(dim=1)"
    assert repr(lay.stacked_placements()) == "(Replicate(), Shard(dim=1))"
    assert repr(lay.statistic_placements((0,))) == "(Replicate(), Replicate())"
    assert repr(lay.statistic_placements((1,))) == "(Replicate(), Shard(dim=0))"
