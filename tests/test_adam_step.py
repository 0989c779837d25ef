"""Adam's step count: ``adam_step``, a 0-dim int64 CPU tensor, in memory and in ``state_dict()``
(a tensor as torch keeps ``step``; int64 is exact at any count; on the CPU the bias corrections
need no device sync; torch.distributed.checkpoint's flattened state maps saved keys to in-memory
ones); a count saved in torch's form (``step``, a float32 tensor, or a number) or as an int (older
checkpoints) loads as the same count."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import geomopt
from geomopt.models import get_model
from geomopt.optim import CheckpointError
from geomopt.optim.persist.checkpoint import import_steps


def trained(spec: str = "adamw", steps: int = 3):
    torch.manual_seed(0)
    model = get_model("mlp")
    opt = geomopt.GeomOptimizer(model, spec)
    for k in range(steps):
        grads(model, k)
        opt.step()
    return model, opt


def grads(model, k: int) -> None:
    g = torch.Generator().manual_seed(50 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def is_count(value, n: int) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.shape == ()
            and value.device.type == "cpu" and value.item() == n)


def test_the_count_is_an_int64_tensor_in_memory_and_in_the_state_dict():
    _, opt = trained()
    sd = opt.state_dict()
    for st in (*opt.state.values(), *sd["state"].values()):
        assert is_count(st["adam_step"], 3) and "step" not in st


def test_an_int64_count_is_exact_past_float32s_integers():
    """At 2²⁴ + 1 steps (float32's first integer it cannot hold) the count resumes as it was and
    the bias corrections are the int's: the same parameters as the same state with an int count."""
    model, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    n = 2 ** 24 + 1
    outs = []
    for form in (torch.tensor(n, dtype=torch.int64), n):
        for st in sd["state"].values():
            st["adam_step"] = form
        m = copy.deepcopy(model)
        o = geomopt.GeomOptimizer(m, "adamw")
        o.load_state_dict(copy.deepcopy(sd))
        assert all(is_count(st["adam_step"], n) for st in o.state.values())
        grads(m, 7)
        o.step()
        assert all(is_count(st["adam_step"], n + 1) for st in o.state.values())
        outs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("form", ["float32 tensor", "float", "int", "int adam_step"])
def test_a_count_in_torchs_form_resumes_bit_for_bit(form):
    """A state dict whose counts were written as torch's AdamW writes them (``step``, a float32
    tensor) or as numbers loads, and the run continues exactly as the uninterrupted one."""
    model, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        n = int(st.pop("adam_step"))
        if form == "int adam_step":  # as older checkpoints saved it
            st["adam_step"] = n
        else:
            st["step"] = {"float32 tensor": torch.tensor(float(n)), "float": float(n), "int": n}[form]
    m = copy.deepcopy(model)
    o = geomopt.GeomOptimizer(m, "adamw")
    o.load_state_dict(sd)
    assert all(is_count(st["adam_step"], 3) and "step" not in st for st in o.state.values())
    for k in range(3, 5):
        for mm, oo in ((model, opt), (m, o)):
            grads(mm, k)
            oo.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m.parameters()))


def test_a_torch_step_that_is_not_a_count_is_refused_by_its_name():
    model, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    st = next(iter(sd["state"].values()))
    del st["adam_step"]
    st["step"] = torch.tensor(2.5)
    with pytest.raises(CheckpointError, match="'step'"):
        geomopt.GeomOptimizer(copy.deepcopy(model), "adamw").load_state_dict(sd)
    for bad in (-1, 2.5, torch.tensor([1.0, 2.0]), "3", True):  # left for the load's checks to name
        assert import_steps({"step": bad}) == {"step": bad}
    out = import_steps({"exp_avg": 0, "step": torch.tensor(7.0)})
    assert out.keys() == {"exp_avg", "adam_step"} and is_count(out["adam_step"], 7)


def test_torch_load_weights_only_reads_the_saved_state():
    model, opt = trained()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = geomopt.GeomOptimizer(copy.deepcopy(model), "adamw")
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert all(is_count(st["adam_step"], 3) for st in fresh.state.values())


def test_state_dict_post_hooks_see_the_finished_dict():
    _, opt = trained(steps=1)
    seen = []
    opt.register_state_dict_post_hook(lambda o, d: seen.append("geomopt" in d))
    opt.state_dict()
    assert seen == [True]
