"""Optimizer state in bfloat16, int8 and int8-ec under DDP, FSDP2, HSDP and FSDP2 × TP (4 gloo CPU
processes, tests/precision_worker.py): each layout stores what one process stores, the int8 block
scales (and int8-ec's corrections) are DTensors cut like their tensors, a tensor whose shards
cannot hold whole blocks keeps float32 state on every rank, and state-dict and DCP round trips
resume bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import layout_worker  # noqa: E402
import precision_worker as worker  # noqa: E402

#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("torchrun")

#: one process against each layout after 2 steps, max over tensors of ‖X − X₁‖_F / ‖X₁‖_F. Without
#: tensor parallelism the gradients are the one-process ones and the state is stored alike: what
#: is left is the optimizer's rounding (an int8 code flips where a shard's norm rounds otherwise).
#: TP splits the forward's matmuls (gradients differ by ~1e-6 relative), which flips a stochastic
#: rounding or an int8 code where a value lies that close to a boundary
BOUND = {"bfloat16": 2e-5, "int8": 5e-5, "int8-ec": 5e-5}
BOUND_TP = {"bfloat16": 3e-4, "int8": 1e-3, "int8-ec": 1e-3}  # measured 7.3e-5 and 2.8e-4 (bf16, int8)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return layout_worker.launch(4, tmp_path_factory.mktemp("state-layouts"), script=worker.__file__)


@pytest.mark.parametrize("layout", worker.LAYOUTS)
@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_each_layout_stores_what_one_process_stores(ranks, layout, name):
    dtype = worker.DTYPES[name]
    bound = (BOUND_TP if layout == "fsdp_tp" else BOUND)[dtype]
    dev = ranks[0]["deviation"][(layout, name)]
    if layout == "ddp":
        assert dev == 0, dev  # the same gradients, the same whole tensors: bit for bit
    assert dev <= bound, (layout, name, dev)


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_int8_state_is_codes_with_block_scales_cut_like_the_tensor(ranks, layout):
    for r in ranks:
        e = r["entries"][(layout, "muon-int8")]
        assert e["model.layers.0.mlp.down_proj.weight"]["d"] == "uint8"
        assert e["lm_head.weight"]["exp_avg_sq"] == "uint8"
        scales = e["model.layers.0.mlp.down_proj.weight"]["d_absmax"]
        want = {"ddp": "float32", "fsdp": "float32 (Shard(dim=0),)", "hsdp": "float32 (Replicate(), Shard(dim=0))",
                "fsdp_tp": "float32 (Shard(dim=0), Shard(dim=1))"}[layout]
        assert scales == want, scales
        ec = r["entries"][(layout, "muon-int8-ec")]["model.layers.0.mlp.down_proj.weight"]
        assert ec["d"] == "uint8" and ec["d_absmax"] == scales  # int8's codes and scales, and corrections
        assert ec["d_ec"] == want.replace("float32", "uint8"), ec  # cut like them
        e16 = r["entries"][(layout, "adamw-hybrid-bfloat16")]
        assert e16["model.layers.0.self_attn.q_proj.weight"]["d"] == "bfloat16"
        assert e16["model.embed_tokens.weight"]["exp_avg"] == "bfloat16"


def test_a_tensor_whose_shards_cannot_hold_whole_blocks_keeps_float32_on_every_rank(ranks):
    """Width 256 under FSDP2 × TP: o_proj's input dim is cut into halves of 128 (and the final
    norm's 256 entries likewise), so neither can keep int8 blocks of 256 within a shard."""
    for r in ranks:
        e = r["entries"][("fsdp_tp", "mixed formats")]
        assert e["model.layers.0.self_attn.o_proj.weight"] == {"d": "float32"}
        assert e["model.norm.weight"] == {"exp_avg": "float32", "exp_avg_sq": "float32"}
        assert e["model.layers.0.self_attn.q_proj.weight"]["d"] == "uint8"


@pytest.mark.parametrize("key", [("fsdp_tp", "muon-int8"), ("fsdp_tp", "adamw-hybrid-bfloat16"),
                                 ("fsdp_tp", "muon-int8-ec"), ("hsdp", "muon-int8"),
                                 ("hsdp", "adamw-hybrid-bfloat16"), ("hsdp", "muon-int8-ec")])
def test_state_dict_and_dcp_round_trips_are_exact(ranks, key):
    for r in ranks:
        assert r["round_trips"][key] == dict(state_dict=True, dcp=True, dtensor_state=True,
                                             placed_like_params=True), (r["rank"], r["round_trips"][key])


def test_sharded_state_bytes_shrink_with_the_precision(ranks):
    """A rank's FSDP2 state: muon's momentum and Adam's moments in bf16 take half the bytes of
    float32, in int8 (codes plus a float32 scale per 256) about a quarter."""
    for r in ranks:
        f32 = r["held"][("fsdp", "muon-float32")]
        assert r["held"][("fsdp", "muon-bfloat16")] / f32 == pytest.approx(0.5, abs=0.01)
        assert 0.25 <= r["held"][("fsdp", "muon-int8")] / f32 <= 0.27
        assert 0.37 <= r["held"][("fsdp", "muon-int8-ec")] / f32 <= 0.39  # half a byte more per entry
