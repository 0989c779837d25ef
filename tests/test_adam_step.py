"""Adam's step count: an int in memory (the bias corrections need no host sync), saved as torch
saves it (``step``, a float32 tensor), and checkpoints that hold the int still load."""

from __future__ import annotations

import copy
import io

import torch

import geomopt
from geomopt.models import get_model
from geomopt.optim.checkpoint import export_steps, import_steps


def trained(spec: str = "adamw", steps: int = 3):
    torch.manual_seed(0)
    model = get_model("mlp")
    opt = geomopt.GeomOptimizer(model, spec)
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return model, opt


def grads(model, k: int) -> None:
    g = torch.Generator().manual_seed(50 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_state_dict_saves_a_float32_step_tensor_like_torch_adamw_and_memory_keeps_the_int():
    model, opt = trained()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters())
    for p in ref_model.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(3):
        ref.step()
    sd = opt.state_dict()
    want = next(iter(ref.state_dict()["state"].values()))["step"]
    for st in sd["state"].values():
        assert "adam_step" not in st
        step = st["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == want.dtype == torch.float32
        assert step.device == want.device and step.shape == want.shape and step.item() == want.item() == 3
    for st in opt.state.values():
        assert st["adam_step"] == 3 and type(st["adam_step"]) is int and "step" not in st
    # a state-dict post-hook sees the saved form (and the geomopt metadata)
    seen = []
    opt.register_state_dict_post_hook(lambda o, d: seen.append((type(next(iter(d["state"].values()))["step"]),
                                                                "geomopt" in d)))
    opt.state_dict()
    assert seen == [(torch.Tensor, True)]


def test_resumed_from_the_saved_steps_bit_for_bit_and_old_int_checkpoints_load():
    model, opt = trained()
    sd = opt.state_dict()
    old = copy.deepcopy(sd)
    for st in old["state"].values():  # what an earlier version saved: the int under adam_step
        st["adam_step"] = int(st.pop("step").item())
    runs = []
    for saved in (sd, old):
        m = copy.deepcopy(model)
        o = geomopt.GeomOptimizer(m, "adamw")
        o.load_state_dict(copy.deepcopy(saved))
        assert all(type(st["adam_step"]) is int and st["adam_step"] == 3 for st in o.state.values())
        runs.append((m, o))
    for k in range(3):
        for m, o in [(model, opt), *runs]:
            grads(m, k)
            o.step()
    for m, _ in runs:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m.parameters()))


def test_torch_load_weights_only_reads_the_saved_state():
    model, opt = trained()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = geomopt.GeomOptimizer(copy.deepcopy(model), "adamw")
    fresh.load_state_dict(loaded)
    assert {st["adam_step"] for st in fresh.state.values()} == {3}


def test_a_count_float32_would_round_is_saved_as_float64_and_comes_back_exact():
    n = (1 << 24) + 1
    out = export_steps({"exp_avg": 0, "adam_step": n})
    assert list(out) == ["exp_avg", "step"] and out["step"].dtype == torch.float64
    assert import_steps(out)["adam_step"] == n and type(import_steps(out)["adam_step"]) is int
    small = export_steps({"adam_step": 7})["step"]
    assert small.dtype == torch.float32 and small.item() == 7
    for bad in (-1, 2.5, torch.tensor([1.0, 2.0]), "3"):  # left for the load's checks to name
        assert import_steps({"step": bad}) == {"step": bad}


def test_the_step_reads_no_step_tensor():
    """The step never reads a tensor step count: a state that holds one only in its saved form
    has the int in memory, so the bias corrections stay host arithmetic (no device sync)."""
    model, opt = trained(steps=1)
    opt.load_state_dict(opt.state_dict())
    grads(model, 0)
    opt.step()
    assert all(type(st["adam_step"]) is int and st["adam_step"] == 2 for st in opt.state.values())
