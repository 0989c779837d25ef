"""Expert parallelism as torchtitan lays it out (``fsdp_ep``): routed experts ``Shard(0)`` over an
``ep`` mesh dim and FSDP2 over ``efsdp``, every other parameter FSDP2 on the dense ``dp_shard``
mesh, on 4 CPU processes (gloo), for every shipped spec and two specs that cover every operator
locality and every post-stage on an MoE model's names, compared with one process.

One ``torchrun --nproc_per_node 4 tests/ep_worker.py`` run (module fixture) does the training.
The gradients are not those of an expert-parallel forward (its token all-to-all is not the
optimizer's business): each step one process computes the whole model's gradient on the step's
batch (a real forward / backward) and each distributed parameter receives its shard as torch lays
it out (an identically parallelized model loaded with the full gradients), see tests/ep_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ep_worker.py")
sys.path.insert(0, str(WORKER.parent))
import ep_worker as worker  # noqa: E402
from refusals import REFUSED_ON_SHARDS  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

#: as tests/test_layouts.py: the shards sum norms and statistics in another order than one process
BOUND = 2e-5
EXPERTS = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(WORKER.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(WORKER),
           str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    loaded = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]
    loaded[0]["seconds"]["fixture"] = time.perf_counter() - t0
    return loaded


@pytest.fixture(scope="module")
def reference(ranks):
    out: dict = {worker.LAYOUTS["fsdp_ep"]: {}, worker.LAYOUTS["fsdp_ep_rows"]: {}}
    for r in ranks:
        out[worker.LAYOUTS["fsdp_ep"]].update(r["ref"])
        out[worker.LAYOUTS["fsdp_ep_rows"]].update(r["ref_rows"])
    return out


def deviation(got: dict, ref: dict) -> float:
    return max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref)


def test_the_worker_covers_every_shipped_spec(ranks, reference):
    from geomopt import shipped_specs

    want = set(shipped_specs()) | {"mixed", "staged"}
    assert set(ranks[0]["fsdp_ep"]) | set(ranks[0]["refused"]["fsdp_ep"]) == want | {"experts_only"}
    assert set(reference[8]) | {"dion"} == want | {"experts_only"}


@pytest.mark.parametrize("layout,name", [("fsdp_ep", n) for n in sorted(worker.SPECS)]
                         + [("fsdp_ep_rows", n) for n in worker.ROWS_SPECS if n in worker.SPECS])
def test_expert_parallel_matches_one_process(ranks, reference, layout, name):
    """Under fsdp_ep_rows, mixed's Frobenius sphere on the router gate (2 rows over 4 ranks: a cut
    DTensor cannot flatten) runs as a matrix function gathered on one rank."""
    refused = ranks[0]["refused"][layout]
    if name in refused:  # a rule of this spec refuses sharded tensors on this model: its refusal, saying why
        assert REFUSED_ON_SHARDS.get(name, "(not expected to refuse)") in refused[name], (layout, refused[name])
        return
    experts = worker.LAYOUTS[layout]
    ref = reference[experts][name]["params"]
    got = ranks[0][layout][name]
    assert got.keys() == ref.keys()
    assert deviation(got, ref) <= BOUND, (layout, name, deviation(got, ref))
    start = worker.make_model(experts).state_dict()
    assert any(not torch.equal(got[k], start[k]) for k in ref)  # the run moved the weights
    assert all(not torch.equal(got[k], start[k]) for k in ref if k.split(".")[-1] in EXPERTS), name


def test_placements_are_torchtitans(ranks):
    """Experts: Shard(0) over ep, FSDP2's strided Shard(0) over efsdp (E = 8), or FSDP2's Shard(1)
    when efsdp × ep > E (E = 2); everything else FSDP2 on the dense 4-rank mesh."""
    for layout, expert in (("fsdp_ep", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
                           ("fsdp_ep_rows", "(Shard(dim=1), Shard(dim=0))")):
        pl, meshes = ranks[0]["placements"][layout], ranks[0]["meshes"][layout]
        for name, p in pl.items():
            if name.split(".")[-1] in EXPERTS:
                assert p == expert and meshes[name] == ("efsdp", "ep"), (layout, name, p, meshes[name])
            else:
                assert p == "(Shard(dim=0),)" and meshes[name] == ("dp_shard",), (layout, name, p, meshes[name])
        assert sum(n.split(".")[-1] in EXPERTS for n in pl) == 6


def test_each_rank_orthogonalizes_its_own_experts(ranks, reference):
    """E = 8 over 4 ranks: each rank holds 2 whole experts of each weight and computes exactly their
    matrix work (a quarter of one process's), and sends ~nothing for them; cut across rows (E = 2)
    they are gathered by their owners instead, which sends a fifth of the parameters' bytes."""
    ref = reference[8]["experts_only"]["flops"]
    assert ref > 0
    for r in ranks:
        assert r["work"]["fsdp_ep"]["experts_only"] == pytest.approx(ref / 4, rel=1e-12), r["rank"]
        assert r["sent"]["fsdp_ep"]["experts_only"] < 1e-3, r["sent"]
        assert r["sent"]["fsdp_ep_rows"]["experts_only"] > 0.05, r["sent"]
    rows = reference[2]["experts_only"]["flops"]
    assert sum(r["work"]["fsdp_ep_rows"]["experts_only"] for r in ranks) == pytest.approx(rows, rel=1e-12)


@pytest.mark.parametrize("name", ["muon", "adamw-hybrid", "spectral-clip", "normuon"])
def test_bytes_sent_per_step(ranks, name):
    """What a rank hands to collectives in one step, over the parameter bytes: finite, below a
    whole gather of the model (3 × over 4 ranks), and above the expert-only spec's (the dense
    matrices are gathered by their owners); the experts cut whole send less than cut by rows."""
    for r in ranks:
        sent = r["sent"]["fsdp_ep"][name]
        assert 0 < sent < 3 and sent == sent, (name, sent)
        assert sent > r["sent"]["fsdp_ep"]["experts_only"]
        if name == "muon":
            assert sent < r["sent"]["fsdp_ep_rows"]["muon"]


@pytest.mark.parametrize("name", ["muon", "staged"])
def test_state_dict_and_dcp_round_trips_are_exact(ranks, name):
    for r in ranks:
        assert r["round_trips"][name] == dict(state_dict=True, dcp=True, moved=True), (name, r["round_trips"])

