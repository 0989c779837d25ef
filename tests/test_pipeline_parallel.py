"""Pipeline parallelism × FSDP2 (layout ``pp_fsdp``), torchtitan's way, on 4 gloo CPU processes:
torchtitan's llama3 debug model (shrunk) split into 2 stages by torchtitan's pipeline code, each part
FSDP2-sharded over its stage's 2 ranks, gradients from a real pipeline schedule (GPipe, 2
microbatches), one GeomOptimizer per part built through torchtitan's container. Every shipped spec
and the locality / post-stage specs (tests/pp_worker.py) train 2 steps and are compared with one
process; the checkpoints (the container's flat state dict, DCP) resume bit for bit; each stage's
optimizer talks only to its stage's ranks; bytes sent per step are recorded.

One ``torchrun --nproc_per_node 4 tests/pp_worker.py`` run (module fixture, ~30 s) does the work;
the tests read what each rank saved.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("pp_worker.py")
sys.path.insert(0, str(WORKER.parent))
import pp_worker as worker  # noqa: E402
from refusals import REFUSED_ON_SHARDS  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

#: max over tensors of ‖X − X_ref‖_F / ‖X_ref‖_F after 2 steps: tests/test_layouts.py's bound, for
#: the optimizer's own deviation (the reference given the pipeline's microbatched gradients)
BOUND = 2e-5
#: the pipeline's gradients are sums over microbatches, which round otherwise than one backward of
#: the whole batch (measured ≤ 1.5e-7 relative)
GRAD_BOUND = 1e-6
STAGE_RANKS = {0: (0, 1), 1: (2, 3)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(WORKER.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(WORKER),
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def merged(ranks, key: str) -> dict:
    out: dict = {}
    for r in ranks:
        for spec, tensors in r[key].items():
            out.setdefault(spec, {}).update(tensors)
    return out


@pytest.fixture(scope="module")
def pp(ranks):
    return merged(ranks, "pp_fsdp")


def deviation(got: dict, ref: dict) -> float:
    return max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref)


def test_the_worker_covers_every_shipped_spec(ranks):
    from geomopt import shipped_specs

    for key in ("ref", "ref_microbatched"):
        assert set(merged(ranks, key)) == set(shipped_specs()) | {"mixed", "staged"}


def test_the_layout_is_torchtitans_split_sharded_per_stage(ranks):
    whole = [n for n, _ in worker.make_model().named_parameters()]
    for r in ranks:
        stage = r["stage"]
        assert stage["index"] == r["rank"] // 2 and stage["ranks"] == STAGE_RANKS[stage["index"]]
        assert stage["fqns"] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
        assert set(r["placements"]["pp_fsdp"].values()) == {"(Shard(dim=0),)"}  # FSDP2 on the stage's 1-D mesh
    parts = [set(ranks[0]["placements"]["pp_fsdp"]), set(ranks[2]["placements"]["pp_fsdp"])]
    assert not parts[0] & parts[1] and parts[0] | parts[1] == set(whole)  # torchtitan's canonical names, each once
    assert "layers.1.attention.qkv_linear.wqkv.weight" in parts[1] and "tok_embeddings.weight" in parts[0]


def test_pipeline_gradients_are_the_whole_batch_gradients(ranks):
    for r in ranks:
        assert r["gradients"]["max_rel"] <= GRAD_BOUND, r["gradients"]


@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_pp_fsdp_matches_one_process(ranks, pp, name):
    refused = ranks[0]["refused"]["pp_fsdp"]
    if name in refused:  # a rule of this spec refuses sharded tensors on this model: its refusal, saying why
        for r in ranks:
            assert REFUSED_ON_SHARDS.get(name, "(not expected to refuse)") in r["refused"]["pp_fsdp"].get(name, ""), \
                r["refused"]
        assert name not in pp
        return
    whole = merged(ranks, "ref")[name]["params"]
    microbatched = merged(ranks, "ref_microbatched")[name]["params"]
    got = pp[name]
    assert set(got) == set(whole)  # both stages' tensors, gathered whole
    assert deviation(got, microbatched) <= BOUND, (name, deviation(got, microbatched))
    # against one process on the whole batch: the optimizer's deviation plus what the gradients'
    # rounding alone (microbatched or not, in one process) does to this spec
    alone = deviation(microbatched, whole)
    assert deviation(got, whole) <= BOUND + alone, (name, deviation(got, whole), alone)
    start = worker.make_model().state_dict()
    assert any(not torch.equal(got[k], start[k]) for k in got)  # the run moved the weights


def test_owner_and_elementwise_steps_are_bit_identical_to_one_process_on_the_same_gradients(ranks, pp):
    """Given the pipeline's gradients, Newton–Schulz / polar iterations on each matrix gathered whole
    on its owner, and elementwise (Adam, sign) steps on the local blocks, do one process's arithmetic."""
    microbatched = merged(ranks, "ref_microbatched")
    for name in ("muon", "adamw-hybrid", "muon-polar-express", "adamw", "sign-descent"):
        assert all(torch.equal(pp[name][k], microbatched[name]["params"][k]) for k in pp[name]), name


def test_each_stage_communicates_only_within_its_ranks(ranks):
    """The executor's group is the stage's dp group, and every collective a step issued (seen at
    the dispatcher) was on it: no collective on the world or the other stage (one would hang)."""
    for r in ranks:
        mine = STAGE_RANKS[r["rank"] // 2]
        assert r["executor_group"] and set(r["executor_group"].values()) == {mine}, r["executor_group"]
        for spec, groups in r["groups"].items():
            assert groups and all(tuple(g) == mine for g in groups), (spec, groups)


def test_bytes_sent_per_step_are_recorded(ranks):
    """Bytes one optimizer step sends from a rank, over its part's parameter bytes: the owner
    round trips of the matrix functions move about half of each matrix (less than the part)."""
    for r in ranks:
        sent = r["sent"]["pp_fsdp"]
        assert set(sent) == set(worker.COUNTED)
        for spec, ratio in sent.items():
            assert math.isfinite(ratio) and 0.05 < ratio < 2.0, (r["rank"], spec, ratio)
        assert sent["muon"] < 1.0


@pytest.mark.parametrize("name", worker.ROUND_TRIPS)
def test_state_dict_and_dcp_round_trips_are_exact(ranks, name):
    for r in ranks:
        got = r["round_trips"][name]
        assert (got["state_dict"], got["dcp"], got["moved"]) == (True, True, True), (r["rank"], name, got)
        assert all(k.startswith("state.") for k in got["keys"]) and got["keys"]


def test_qk_clip_is_refused_on_the_stages_sharded_parts(ranks):
    """QK-clip (no shipped spec has it) needs whole attention modules' logit maxima: refused on sharded parameters."""
    for r in ranks:
        assert r["whole_model"]["qk_clip"].startswith("NotImplementedError: qk_clip: sharded (DTensor) parameters")


def test_a_nonfinite_gradient_skips_its_own_stages_step_only(ranks):
    """The non-finite test is per optimizer, over its stage's ranks: a NaN in one rank's block of a
    stage-1 gradient skips stage 1's step on both its ranks (its rule counts it); stage 0, whose
    gradients are finite, steps (one process would skip the whole model's step)."""
    for r in ranks:
        got = r["whole_model"]["nonfinite"]
        if r["rank"] // 2 == 1:
            assert got["unchanged"] and got["skipped"]["hidden"] == 1, got
        else:
            assert not got["unchanged"] and set(got["skipped"].values()) == {0}, got
