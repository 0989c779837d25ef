"""Distributed execution: DDP and FSDP2 on 2 CPU processes (gloo) against single-process runs.

One ``torchrun --nproc_per_node 2 tests/distributed_worker.py`` run (module fixture) trains every
shipped spec and a spec that covers each operator's locality class; the tests read what each rank
saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geomopt import GeomOptimizer
from geomopt.geometry.operators import BACKWARD_OPS, FORWARD_OPS, backward_locality, forward_locality
from geomopt.distributed import (
    LOCAL, OWNER, REDUCE, LocalExecutor, Request, assign,
    make_executor,
)

WORKER = Path(__file__).with_name("distributed_worker.py")
sys.path.insert(0, str(WORKER.parent))
import distributed_worker as worker  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

SPECS = worker.SHIPPED + ["mixed"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # --standalone: the rendezvous takes a free port from the OS (no race for a port number)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _max_rel(a: dict, b: dict, atol: float = 5e-7) -> float:
    """max over tensors of ‖a − b‖∞ / (‖b‖∞ + atol/1e-5). The atol: the attention key bias has an
    exactly zero gradient (softmax ignores it), so its gradient is rounding noise, which the
    shards round their own way and Adam's normalization lifts to steps of up to ~1e-4·lr
    (lr 1e-3, 3 steps here)."""
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + atol / 1e-5)) for k in b)


@pytest.mark.parametrize("name", SPECS)
def test_ddp_matches_single_process(ranks, name):
    for r in ranks:
        assert r["work"][name]["kind"] == "ReplicatedExecutor"
        # the owner runs the same batched kernels on its rows: bit for bit
        assert all(torch.equal(r["ddp"][name][k], r["ref"][name][k]) for k in r["ref"][name]), name


@pytest.mark.parametrize("name", SPECS)
def test_fsdp2_matches_single_process(ranks, name):
    for r in ranks:
        assert r["work"][name]["fsdp_kind"] == "ShardedExecutor"
        # norms summed shard by shard round differently: a few ulps, after 3 steps
        assert _max_rel(r["fsdp"][name], r["ref"][name]) < 1e-5, name


def test_ranks_end_with_identical_parameters(ranks):
    for name in SPECS:
        for mode in ("ddp", "fsdp"):
            a, b = ranks[0][mode][name], ranks[1][mode][name]
            assert all(torch.equal(a[k], b[k]) for k in a), (name, mode)


@pytest.mark.parametrize("name", ["muon", "uscion", "spectral-clip", "mixed"])
def test_spectral_work_per_rank_is_about_half(ranks, name):
    for mode in ("ddp", "fsdp"):
        total = ranks[0]["work"][name]["ref"]
        shares = [r["work"][name][mode] / total for r in ranks]
        assert total > 0
        assert abs(sum(shares) - 1) < 1e-9, (mode, shares)  # every matrix computed once
        assert all(0.35 <= s <= 0.65 for s in shares), (mode, shares)


def test_every_stage_under_ddp_and_fsdp2_matches_single_process(ranks):
    """A spec with every post-stage, cautious decay, heavy-ball and Lion directions and a momentum
    warmup: DDP runs the stages on every rank's full data, bit for bit as one process; FSDP2 runs
    them on the shards with their sums all-reduced (a few ulps: sums taken shard by shard), and its
    checkpoint resumes exactly."""
    for r in ranks:
        s = r["staged"]
        assert s["kind"] == "ReplicatedExecutor" and s["fsdp_kind"] == "ShardedExecutor"
        assert {"d", "post_v", "post_g2", "post_step", "exp_avg", "exp_avg_sq"} <= set(s["state"])
        assert all(torch.equal(s["ddp"][k], s["ref"][k]) for k in s["ref"])
        assert any(not torch.equal(s["ref"][k], worker.make_model().state_dict()[k]) for k in s["ref"])
        assert _max_rel(s["fsdp"], s["ref"]) < 1e-5
        assert s["fsdp_state_is_dtensor"] and s["fsdp_resume_diff"] == 0.0
    for mode in ("ddp", "fsdp"):
        a, b = ranks[0]["staged"][mode], ranks[1]["staged"][mode]
        assert all(torch.equal(a[k], b[k]) for k in a), mode


def test_checkpoint_round_trip_across_two_ranks(ranks):
    a, b = (r["checkpoint"] for r in ranks)
    assert a["keys"] == b["keys"] and a["keys"]
    assert a["sharded_like_params"] and b["sharded_like_params"]
    assert a["diff"] == 0.0 and b["diff"] == 0.0


@pytest.mark.parametrize("which", ["dcp", "dcp_staged"])
def test_distributed_checkpoint_round_trip(ranks, which):
    a, b = (r[which] for r in ranks)
    assert a["keys"] == b["keys"] and all(isinstance(k, str) for k in a["keys"])  # FQNs, same on every rank
    assert a["diff"] == 0.0 and b["diff"] == 0.0


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(ranks):
    for r in ranks:
        assert r["nonfinite"]["unchanged"]
        assert r["nonfinite"]["skipped"]["hidden"] == 1
    assert ranks[0]["nonfinite"]["skipped"] == ranks[1]["nonfinite"]["skipped"]


def test_bad_distributed_input_errors(ranks):
    for r in ranks:
        e = r["errors"]
        assert e["world_size"] and "saved sharded over 4 rank(s)" in e["world_size"] and "2" in e["world_size"]
        assert "torch.distributed.checkpoint" in e["world_size"]
        assert e["ddp_on_dtensor"] and "DTensor" in e["ddp_on_dtensor"]


# ---------------------------------------------------------------- single-process units


def test_every_registered_operator_has_a_locality():
    assert all(forward_locality(kind) in (LOCAL, REDUCE, OWNER) for kind in FORWARD_OPS)
    for g, c in BACKWARD_OPS:
        assert backward_locality(g, c) in (LOCAL, REDUCE, OWNER)
    assert backward_locality("spectral", "frobenius_ball") == OWNER
    assert backward_locality("euclidean", "l2_ball") == REDUCE
    assert backward_locality("anisotropic", "linf_ball") == LOCAL


def test_assign_balances_flops():
    costs = [8.0, 8.0, 4.0, 4.0, 2.0, 2.0, 1.0, 1.0]
    owners = assign(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [15.0, 15.0]
    assert assign(costs, 2) == owners  # deterministic
    assert sorted(set(assign([1.0] * 5, 3))) == [0, 1, 2]


def test_single_process_uses_the_local_executor():
    model = worker.make_model()
    assert isinstance(GeomOptimizer(model, worker.spec_path("muon")).engine.executor, LocalExecutor)
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        make_executor(list(model.parameters()), "ddp", None)
    with pytest.raises(ValueError, match="fully_shard"):
        make_executor(list(model.parameters()), "fsdp", None)
    with pytest.raises(ValueError, match="distributed must be"):
        make_executor(list(model.parameters()), "zero", None)


def test_world_size_mismatch_refused_for_sharded_state():
    model = worker.make_model()
    opt = GeomOptimizer(model, worker.spec_path("uscion"))
    sd = opt.state_dict()
    assert sd["geomopt"]["world_size"] == 1 and sd["geomopt"]["sharded"] is False
    sd["geomopt"].update(world_size=2, sharded=True)
    with pytest.raises(ValueError, match="saved sharded over 2 rank"):
        opt.load_state_dict(sd)
    sd["geomopt"].update(sharded=False)  # replicated (DDP) state loads at any world size
    opt.load_state_dict(sd)


def test_distributed_benchmark_halves_the_matrices_per_rank():
    """benchmarks/distributed.py end to end (1 and 2 gloo ranks, one timed step)."""
    script = WORKER.parents[1] / "benchmarks" / "distributed.py"
    # this checkout's package in the script and its ranks, whatever else is installed
    path = os.pathsep.join(filter(None, [str(WORKER.parents[1]), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), "--spec", str(worker.spec_path("muon")), "--iters", "1",
                           "--warmup", "0", "--ranks", "1", "2"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| muon |")]
    per_rank = {(int(r[1]), int(r[2])): float(r[3]) for r in rows}
    assert per_rank == {(1, 0): 8.0, (2, 0): 4.0, (2, 1): 4.0}


def test_request_cost_sums_the_matrices_of_a_view():
    """The work estimate that balances matrix functions across ranks counts E expert matrices of an
    (E, out, in) weight, not one E × out·in matrix."""
    import geomopt

    w = torch.nn.Parameter(torch.zeros(4, 16, 8))
    spec = {"geomopt": 1, "name": "e", "rules": [{"name": "x", "match": "**", "geometry": {
        "kind": "spectral", "reference": {"kind": "indicator"}, "view": {"kind": "matrix", "batch": 1}}}]}
    opt = geomopt.GeomOptimizer([("experts.w", w)], spec)
    pp = opt.plan["experts.w"]
    from geomopt.optim.engine.requests import request

    req = request(opt.engine.rt, [(w, pp)], torch.zeros(1, 4, 16, 8), "owner", None)
    assert req.row_cost() == 4 * 16 * 8 * 8
    assert Request(None, torch.zeros(1, 4, 16, 8), "owner").row_cost() == 4 * 128 * 4  # the plain reading
