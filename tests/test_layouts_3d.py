"""The same update on a 3-D mesh: HSDP × TP, a 2 × 2 × 2 (replicate, shard, tp) mesh of 8 CPU
processes (gloo), for every shipped spec and the two specs that cover every operator locality and
every post-stage, on an HF Llama built from a config, against one process.

One ``torchrun --nproc_per_node 8 tests/layout_worker.py`` run (module fixture) trains; the tests
read what each rank saved (tests/test_layouts.py holds the 4-process layouts).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import layout_worker as worker  # noqa: E402
from test_layouts import BOUND, deviation  # noqa: E402
from refusals import REFUSED_ON_SHARDS  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

LAYOUT = "hsdp_tp"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return worker.launch(8, tmp_path_factory.mktemp("layouts3d"))


@pytest.fixture(scope="module")
def reference(ranks):
    return worker.merged(ranks, "ref")


def test_the_eight_ranks_split_the_references(ranks, reference):
    from geomopt import shipped_specs

    assert set(reference) == set(shipped_specs()) | {"mixed", "staged", "shampoo-bf16-factors"}
    assert all(r["ref"] for r in ranks)


@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_hsdp_tp_matches_one_process(ranks, reference, name):
    refused = ranks[0].get("refused", {}).get(LAYOUT, {})
    if name in refused:  # a rule of this spec refuses sharded tensors on this model: its refusal, saying why
        assert REFUSED_ON_SHARDS.get(name, "(not expected to refuse)") in refused[name], refused[name]
        return
    ref, got = reference[name]["params"], ranks[0][LAYOUT][name]
    assert deviation(got, ref) <= BOUND, (name, deviation(got, ref))
    start = worker.make_model().state_dict()
    assert any(not torch.equal(got[k], start[k]) for k in ref)


def test_the_mesh_is_three_dimensional(ranks):
    p = ranks[0]["placements"][LAYOUT]
    # column-wise TP under HSDP: replicated over 'rep', FSDP2's strided cut of each TP chunk on 'shard'
    assert p["model.layers.0.self_attn.q_proj.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert p["model.layers.1.mlp.down_proj.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"  # row-wise
    assert p["model.norm.weight"] == "(Replicate(), Shard(dim=0))"  # HSDP only, on the (rep, shard) sub-mesh
    assert ranks[0]["executor"][LAYOUT] == "ShardedExecutor"


def test_matrix_work_is_spread_over_all_eight_ranks(ranks, reference):
    """Each matrix is computed once per step over the whole world (no replica recomputes it) and
    every rank takes a share; where the matrices are many and alike (muon, staged: 14 and 10 per
    step) the shares are within 25% of an eighth (mixed's few SVDs of unlike sizes cannot be)."""
    for name in ("muon", "mixed", "staged"):
        total = reference[name]["flops"]
        shares = [r["work"][LAYOUT][name] for r in ranks]
        assert sum(shares) == pytest.approx(total, rel=1e-9), name
        assert min(shares) > 0, (name, shares)
        if name != "mixed":
            assert max(shares) <= total / 8 * 1.25, (name, shares)


@pytest.mark.parametrize("spec", ["staged", "mixed"])
def test_state_dict_and_dcp_round_trips_are_exact(ranks, spec):
    for r in ranks:
        got = r["round_trips"][(LAYOUT, spec)]
        assert got == dict(state_dict=True, dcp=True, dtensor_state=True, placed_like_params=True), (r["rank"], got)


def test_update_norms_count_each_block_once(ranks):
    for r in ranks:
        d = r["diagnostics"]
        assert d[LAYOUT].keys() == d["ref"].keys()
        for rule, norm in d["ref"].items():
            assert d[LAYOUT][rule] == pytest.approx(norm, rel=1e-4), rule


def test_a_nonfinite_gradient_in_one_block_skips_the_step_on_every_rank(ranks):
    for r in ranks:
        assert r["nonfinite"]["unchanged"]
        assert r["nonfinite"]["skipped"]["hidden"] == 1
    assert len({str(r["nonfinite"]["skipped"]) for r in ranks}) == 1


def test_refusals_name_the_parameter_and_its_placements(ranks):
    for r in ranks:
        e = r["errors"]
        assert e["partial"] and "'blocks.0.w'" in e["partial"] and "Partial" in e["partial"]
        assert "supported:" in e["partial"]
        assert e["mesh_change"] and "torch.distributed.checkpoint" in e["mesh_change"]
        assert "2x2x2 (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" in e["mesh_change"]


def test_bytes_sent_per_step_are_recorded(ranks):
    """The optimizer's own traffic per step, ÷ the parameter bytes: finite on every rank, and
    Muon's all-to-all rounds send less than gathering every matrix to every rank would
    (2 × (world − 1) / world of the parameters)."""
    for r in ranks:
        sent = r["sent"][LAYOUT]
        assert all(math.isfinite(v) and v >= 0 for v in sent.values()), sent
        assert 0 < sent["muon"] < 2 * 7 / 8, sent["muon"]
