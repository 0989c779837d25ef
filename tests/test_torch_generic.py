"""PyTorch's generic optimizer checks (TestOptimRenewed in PyTorch's test/test_optim.py), written
here for geomopt's shipped specs behind torch's constructor (tests/torch_optim_infos.py registers
them as OptimizerInfo entries). Each check torch runs on CPU is a test below or is listed, with its
reason, in torch_optim_infos.NOT_APPLICABLE, which docs/guide/torch-contract.md shows."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_optim_infos import COVERED, CUDA_ONLY, GEOM_OPTIM_DB, KWARGS_NOT_APPLICABLE, NOT_APPLICABLE

INFOS = pytest.mark.parametrize("info", GEOM_OPTIM_DB, ids=lambda i: i.name)
DOC = Path(__file__).resolve().parents[1] / "docs" / "guide" / "torch-contract.md"


def inputs(info):
    return info.optim_inputs_func(device="cpu")


def weight_bias(dtype=torch.float32, contiguous=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return (Parameter(torch.randn(10, 5, generator=g, dtype=dtype)),
                Parameter(torch.randn(10, generator=g, dtype=dtype)))
    return (Parameter(torch.randn(10, 5, 2, generator=g, dtype=dtype)[..., 0]),
            Parameter(torch.randn(10, 2, generator=g, dtype=dtype)[..., 0]))


def loss_closure(opt, w, b, x):
    def closure():
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss
    return closure


def same(a, b, exact=True):
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------ the table itself

def test_every_cpu_check_is_covered_or_listed_once_and_names_a_test_here():
    assert not set(COVERED) & set(NOT_APPLICABLE) and not set(CUDA_ONLY) & (set(COVERED) | set(NOT_APPLICABLE))
    here = {name for name, _ in inspect.getmembers(__import__(__name__), inspect.isfunction)}
    assert set(COVERED.values()) <= here, set(COVERED.values()) - here


def test_the_docs_page_shows_the_table():
    """docs/guide/torch-contract.md lists every check as this module's table does: covered ones
    with their test, the others with the same reason word for word."""
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `(test_\w+)` \| (.+?) \|$", text, re.M))
    for name, test in COVERED.items():
        assert rows.get(name) == f"`{test}`", name
    for name, why in NOT_APPLICABLE.items():
        assert rows.get(name) == f"not applicable: {why}", name
    for name in CUDA_ONLY:
        assert rows.get(name) == "CUDA only", name
    for kwarg, why in KWARGS_NOT_APPLICABLE.items():
        assert f"| `{kwarg}` | {why} |" in text, kwarg
    assert set(rows) == set(COVERED) | set(NOT_APPLICABLE) | set(CUDA_ONLY)


@INFOS
def test_optim_inputs_set_no_global_flags(info):
    for i in inputs(info):
        assert not {"foreach", "fused", "differentiable", "implementation"} & set(i.kwargs)


# ------------------------------------------------------------ errors

@INFOS
def test_errors(info):
    w, b = weight_bias()
    for kwargs, kind, words in [(dict(lr=-1.0), ValueError, "lr="), (dict(weight_decay=-0.5), ValueError,
                                "weight_decay="), (dict(implementation="loop"), ValueError, "implementation")]:
        with pytest.raises(kind, match=words):
            info.optim_cls([w, b], **kwargs)
    if not info.supports_sparse:
        opt = info.optim_cls([w, b])
        w.grad = torch.zeros_like(w).to_sparse()
        with pytest.raises(RuntimeError, match="sparse gradient"):
            opt.step()


def drosenbrock(t):
    x, y = t
    return torch.stack((-400 * x * (y - x ** 2) - 2 * (1 - x), 200 * (y - x ** 2)))


@pytest.mark.parametrize("info", [i for i in GEOM_OPTIM_DB if i.supports_sparse], ids=lambda i: i.name)
@pytest.mark.parametrize("with_lrsched", [False, True])
def test_rosenbrock_sparse(info, with_lrsched):
    """torch's check: cyclic coordinate descent on Rosenbrock's function, each step's gradient an
    uncoalesced sparse tensor (one coordinate, split in two entries) against its dense form; the
    parameters agree after every step and end nearer the minimum (float64, torch's lr)."""
    kwargs, scheds = info.metadata_for_sparse
    p, q = (Parameter(torch.tensor([1.5, 1.5], dtype=torch.float64)) for _ in range(2))
    sparse, dense = info.optim_cls([p], **kwargs), info.optim_cls([q], **kwargs)
    schedulers = [s(o) for s in scheds for o in (sparse, dense)] if with_lrsched else []
    start = p.detach().dist(torch.ones(2, dtype=torch.float64))
    for i in range(2000):
        k = i % 2
        g = drosenbrock(p.detach())[k]
        vals = torch.stack((g / 4, g - g / 4)) if k == 0 else torch.stack((g - g / 4, g / 4))
        p.grad = torch.sparse_coo_tensor(torch.tensor([[k, k]]), vals, (2,), check_invariants=True)
        q.grad = p.grad.to_dense()
        sparse.step()
        dense.step()
        for s in schedulers:
            s.step()
        same(p, q)
    assert p.detach().dist(torch.ones(2, dtype=torch.float64)) <= start


# ------------------------------------------------------------ progress

@INFOS
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
def test_goes_right_direction(info, contiguous, with_lrsched):
    """20 steps (each through step(closure), which returns the loss) lower the loss, under the
    scheduler inputs torch gives every optimizer (StepLR, ReduceLROnPlateau) or none."""
    for scheds in info.scheduler_inputs if with_lrsched else [[]]:
        for i in inputs(info):
            w, b = weight_bias(contiguous=contiguous)
            x = torch.randn(5, generator=torch.Generator().manual_seed(9))
            opt = info.optim_cls([w, b], **i.kwargs)
            schedulers = [s(opt) for s in scheds]
            closure = loss_closure(opt, w, b, x)
            first = closure().item()
            for _ in range(20):
                loss = opt.step(closure)
                assert isinstance(loss, torch.Tensor)
                for s in schedulers:
                    s.step(loss.item()) if isinstance(s, ReduceLROnPlateau) else s.step()
            assert closure().item() < first, (i.desc, scheds)


@INFOS
def test_param_group_dicts_with_scheduler_go_right(info):
    """Param-group dicts (without per-group options: a group is a spec rule) and a scheduler."""
    for scheds in info.scheduler_inputs:
        w, b = weight_bias()
        x = torch.randn(5, generator=torch.Generator().manual_seed(9))
        opt = info.optim_cls([{"params": [w]}, {"params": [b]}])
        schedulers = [s(opt) for s in scheds]
        closure = loss_closure(opt, w, b, x)
        first = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for s in schedulers:
                s.step(loss.item()) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < first


@INFOS
def test_tensor_lr(info):
    """lr= as a tensor is taken as torch takes it (the default lr's groups hold it); a tensor lr set in a group
    (by hand or by a scheduler) stays a tensor and steps exactly as the same float lr."""
    w, b = weight_bias()
    lr = torch.tensor(1e-3)
    held = [g["lr"] is lr for g in info.optim_cls([w, b], lr=lr).param_groups]  # a rule's own lr stays
    assert any(held)
    (w1, b1), (w2, b2) = weight_bias(), weight_bias()
    x = torch.randn(5, generator=torch.Generator().manual_seed(9))
    o1, o2 = info.optim_cls([w1, b1], lr=1e-3), info.optim_cls([w2, b2], lr=1e-3)
    for g in o2.param_groups:
        g["lr"] = torch.tensor(g["lr"])
    for _ in range(5):
        o1.step(loss_closure(o1, w1, b1, x))
        o2.step(loss_closure(o2, w2, b2, x))
    assert all(isinstance(g["lr"], torch.Tensor) for g in o2.param_groups)
    same(w1, w2, exact=False)
    same(b1, b2, exact=False)
    sched = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.5)
    o2.step(loss_closure(o2, w2, b2, x))
    sched.step()
    assert all(isinstance(g["lr"], torch.Tensor) for g in o2.param_groups)
    sd = o2.state_dict()
    o3 = info.optim_cls(list(weight_bias()), lr=1e-3)
    o3.load_state_dict(sd)
    assert all(isinstance(g["lr"], torch.Tensor) and g["lr"] is not s["lr"]
               for g, s in zip(o3.param_groups, sd["param_groups"]))


# ------------------------------------------------------------ complex

@INFOS
def test_complex(info):
    """A complex tensor steps as its real view (torch's test: the last parameter stays real)."""
    for i in inputs(info):
        g = torch.Generator().manual_seed(3)
        cs = [torch.randn(10, 5, dtype=torch.complex64, generator=g).requires_grad_(),
              torch.randn(10, dtype=torch.complex64, generator=g).requires_grad_(),
              torch.randn(10, 5, generator=g).requires_grad_()]
        if not info.supports_complex:
            with pytest.raises(ValueError, match="complex"):
                info.optim_cls(cs, **i.kwargs)
            continue
        rs = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in cs]
        oc, orr = info.optim_cls(cs, **i.kwargs), info.optim_cls(rs, **i.kwargs)
        for _ in range(3):
            for c, r in zip(cs, rs):
                r.grad = torch.randn(r.shape, generator=g)
                c.grad = torch.view_as_complex(r.grad.clone()) if c.is_complex() else r.grad.clone()
            oc.step()
            orr.step()
        for c, r in zip(cs, rs):
            same(torch.view_as_real(c) if c.is_complex() else c, r)


def rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


@INFOS
def test_complex_2d(info):
    """One complex 2-vector against its real and imaginary parts as two real tensors."""
    if not info.supports_complex:
        return  # refused (test_complex)
    for i in inputs(info):
        a = torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        re, im = a.real.detach().clone().requires_grad_(), a.imag.detach().clone().requires_grad_()
        o1 = info.optim_cls([a], **i.kwargs)
        o2 = info.optim_cls([re, im], **i.kwargs)
        for _ in range(3):
            o1.zero_grad()
            o2.zero_grad()
            rosenbrock(a).abs().backward()
            rosenbrock(torch.complex(re, im)).abs().backward()
            same(a.grad.real, re.grad)
            same(a.grad.imag, im.grad)
            o1.step()
            o2.step()
            same(a.real, re)
            same(a.imag, im)


# ------------------------------------------------------------ implementations

def small_model(dtype):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                               torch.nn.Sigmoid()).to(dtype)


@INFOS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_foreach_matches_fused_and_auto(info, dtype):
    """torch's foreach/fused-against-forloop check mapped to implementation=: 'foreach' (the
    unfused ops) against 'fused' and 'auto', over 7 steps with grads None at step 2, a layer frozen
    at steps 3–4, and a one-entry 0-dim parameter last; parameters and state agree (within
    torch's tolerances for the dtype: the fused kernel rounds differently), and every state value
    is a tensor, as torch's comparisons need (Adam's count too)."""
    for i in inputs(info):
        runs = []
        for impl in ("foreach", "fused", "auto"):
            model = small_model(dtype)
            extra = torch.empty((), dtype=dtype).uniform_(generator=torch.Generator().manual_seed(2)).requires_grad_()
            extra.grad = torch.rand_like(extra)
            params = [*model.parameters(), extra]
            opt = info.optim_cls(params, implementation=impl, **i.kwargs)
            x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
            for k in range(7):
                opt.zero_grad()
                model[2].requires_grad_(not 3 <= k < 5)
                if k != 2:
                    model(x).sum().backward()
                opt.step()
            runs.append((params, opt))
        (ps, o), rest = runs[0], runs[1:]
        for qs, q in rest:
            for p, r in zip(ps, qs):
                same(p, r, exact=False)
                assert o.state[p].keys() == q.state[r].keys()
                for key, v in o.state[p].items():  # every value a tensor (torch's TensorTracker reads them so)
                    assert isinstance(v, torch.Tensor), key
                    same(v, q.state[r][key], exact=False)


# ------------------------------------------------------------ no-op steps

@INFOS
def test_step_is_noop_without_grads(info):
    """requires_grad=False tensors (no gradient ever) and None gradients: nothing moves, no state."""
    ps = [torch.randn(2, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    old = [p.clone() for p in ps]
    for i in inputs(info):
        opt = info.optim_cls(ps, **i.kwargs)
        assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
        assert all(torch.equal(a, b) for a, b in zip(ps, old)) and not any(opt.state.values())


@INFOS
def test_step_is_noop_for_zero_grads(info):
    """Zero gradients without weight decay leave the parameter as it was, every bit."""
    p = torch.randn(5, 1, generator=torch.Generator().manual_seed(0)).requires_grad_()
    old = p.detach().clone()
    for i in inputs(info):
        opt = info.optim_cls([p], **dict(i.kwargs, weight_decay=0.0))
        p.grad = torch.zeros_like(p)
        opt.step(lambda: torch.tensor([1.0]))
        assert torch.equal(p.detach(), old), i.desc


@INFOS
def test_duplicate_params_in_one_param_group(info):
    """torch's check: one warning, in torch's words, for a tensor given twice; geomopt steps it
    once (torch's loop steps it twice), as the same tensor given once."""
    for i in inputs(info):
        p, q = (Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0))) for _ in range(2))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            twice = info.optim_cls([p, p], **i.kwargs)
        # torch's assertWarnsOnceRegex: this warning exactly once (a role-routed spec on bare tensors also warns
        # that their roles were guessed)
        assert sum("a parameter group with duplicate parameters" in str(x.message) for x in w) == 1, i.desc
        once = info.optim_cls([q], **i.kwargs)
        for k in range(3):
            p.grad = q.grad = torch.randn(4, generator=torch.Generator().manual_seed(k))
            twice.step()
            once.step()
        same(p, q)
    with pytest.raises(ValueError, match="earlier group"):
        info.optim_cls([{"params": [p]}, {"params": [p]}])


@INFOS
def test_zero_grad_sets_to_none_or_zeroes(info):
    w, b = weight_bias()
    opt = info.optim_cls([w, b])
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    opt.zero_grad()
    assert w.grad is None and b.grad is None


@INFOS
def test_can_be_printed(info):
    for i in inputs(info):
        text = repr(info.optim_cls(list(weight_bias()), **i.kwargs))
        assert text.startswith(info.name) and "Parameter Group 0" in text


@INFOS
def test_non_empty_state(info):
    """Every stepped tensor holds state, except under a rule that keeps none (SGD without
    momentum): torch's SGD keeps ``momentum_buffer: None`` there, geomopt no entry (nothing to
    resume: docs/guide/torch-contract.md), which this checks stays so."""
    model = torch.nn.Linear(5, 5)
    for i in inputs(info):
        opt = info.optim_cls(model.parameters(), **i.kwargs)
        opt.zero_grad()
        model(torch.rand(2, 5)).sum().backward()
        opt.step()
        if i.kwargs.get("momentum") == 0:  # euclidean geometry, direction none: a stateless rule
            assert not any(opt.state.values()) and not any(opt.state_dict()["state"].values()), i.desc
        else:
            assert opt.state and all(len(st) > 0 for st in opt.state.values()), i.desc


# ------------------------------------------------------------ dtypes and layouts

@INFOS
def test_mixed_dtypes_step_like_each_alone(info):
    """float32 and float64 parameters in one optimizer step as each does alone, bit for bit."""
    (w32, _), (_, b64) = weight_bias(torch.float32), weight_bias(torch.float64)
    (w_alone, _), (_, b_alone) = weight_bias(torch.float32), weight_bias(torch.float64)
    mixed, a32, a64 = info.optim_cls([w32, b64]), info.optim_cls([w_alone]), info.optim_cls([b_alone])
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        gw, gb = torch.randn(10, 5, generator=g), torch.randn(10, generator=g, dtype=torch.float64)
        w32.grad, w_alone.grad, b64.grad, b_alone.grad = gw.clone(), gw.clone(), gb.clone(), gb.clone()
        for o in (mixed, a32, a64):
            o.step()
    assert w32.dtype == torch.float32 and b64.dtype == torch.float64
    same(w32, w_alone)
    same(b64, b_alone)


@INFOS
def test_non_contiguous_parameters_step_like_contiguous_ones(info):
    (w, b), (wc, bc) = weight_bias(contiguous=False), weight_bias(contiguous=False)
    wc, bc = Parameter(wc.detach().contiguous()), Parameter(bc.detach().contiguous())
    assert not w.is_contiguous()
    o1, o2 = info.optim_cls([w, b]), info.optim_cls([wc, bc])
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        for p, q in ((w, wc), (b, bc)):
            q.grad = torch.randn(q.shape, generator=g)
            p.grad = q.grad.clone()
        o1.step()
        o2.step()
    same(w, wc, exact=False)
    same(b, bc, exact=False)


# ------------------------------------------------------------ state dicts

def primed(info, kwargs=None, steps=10, named=False):
    w, b = weight_bias()
    x = torch.randn(3 if w.shape[1] == 3 else 5, generator=torch.Generator().manual_seed(4))
    opt = info.optim_cls([("weight", w), ("bias", b)] if named else [w, b], **(kwargs or {}))
    closure = loss_closure(opt, w, b, x)
    for _ in range(steps):
        opt.step(closure)
    return (w, b, x), opt


def count_tensor(v) -> bool:
    """A step count as torch's optimizers keep one: a tensor (geomopt's: 0-dim int64, on the CPU)."""
    return isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 0 and v.device.type == "cpu"


def assert_same_state_dicts(a, b):
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"] or all(
        str(g) == str(h) for g, h in zip(a["param_groups"], b["param_groups"]))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][key]) if isinstance(v, torch.Tensor) else v == b["state"][i][key]


@INFOS
def test_state_dict_deterministic(info):
    """A fresh optimizer on clones loads the state and then steps bit for bit with the original;
    the loaded dict is unchanged (deep-copied, not aliased) and both state dicts agree."""
    for i in inputs(info):
        (w, b, x), opt = primed(info, i.kwargs)
        wc, bc = Parameter(w.detach().clone()), Parameter(b.detach().clone())
        oc = info.optim_cls([wc, bc], **i.kwargs)
        sd = copy.deepcopy(opt.state_dict())
        kept = copy.deepcopy(sd)
        oc.load_state_dict(sd)
        for _ in range(10):
            opt.step(loss_closure(opt, w, b, x))
            oc.step(loss_closure(oc, wc, bc, x))
            same(w, wc)
            same(b, bc)
        assert_same_state_dicts(sd, kept)  # loading and stepping did not write into the loaded dict
        assert_same_state_dicts(opt.state_dict(), oc.state_dict())


@INFOS
def test_can_load_older_state_dict(info):
    """A checkpoint whose Adam counts were written in torch's form (``step``, a float32 tensor) by
    torch-side tools loads, and the optimizer steps on."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2))
    x = torch.rand(1, 4, 16, 16)
    for i in inputs(info):
        opt = info.optim_cls(model.parameters(), **i.kwargs)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        old = copy.deepcopy(opt.state_dict())
        for st in old["state"].values():
            if "adam_step" in st:
                st["step"] = torch.tensor(float(st.pop("adam_step")))
        opt.load_state_dict(old)
        assert all("step" not in st and count_tensor(st.get("adam_step", torch.tensor(0))) for st in opt.state.values())
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


@INFOS
@pytest.mark.parametrize("named0", [True, False], ids=["named", "unnamed"])
@pytest.mark.parametrize("named1", [True, False], ids=["to_named", "to_unnamed"])
def test_load_named_state_dict(info, named0, named1):
    """torch's check: a state saved by a named or an unnamed optimizer loads into a named or an
    unnamed one (names are optional: tensors match by position), which then steps as the
    original; each keeps its own names. Real names that differ (another model) are refused,
    naming the tensor."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2))
    x = torch.rand(1, 4, 16, 16)

    def make(m, named):
        return info.optim_cls(m.named_parameters() if named else m.parameters())

    def run(opt, m):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    opt = make(model, named0)
    for _ in range(3):
        run(opt, model)
    twin = copy.deepcopy(model)
    again = make(twin, named1)
    mine = [n for g in again.state_dict()["param_groups"] for n in g["param_names"]]
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [n for g in again.state_dict()["param_groups"] for n in g["param_names"]] == mine
    for _ in range(3):
        run(opt, model)
        run(again, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        same(p, q)
    if named0 and named1:
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][0]["param_names"][0] = "other.weight"
        with pytest.raises(ValueError, match="'other.weight'"):
            make(copy.deepcopy(model), True).load_state_dict(sd)


@INFOS
def test_save_load_weights_only(info):
    for i in inputs(info):
        _, opt = primed(info, i.kwargs, steps=3)
        sd = opt.state_dict()
        for weights_only in (False, True):
            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            assert_same_state_dicts(torch.load(buf, weights_only=weights_only), sd)


@INFOS
def test_load_nontensor_step(info):
    for i in inputs(info):
        (w, b, x), opt = primed(info, i.kwargs, steps=3)
        sd = copy.deepcopy(opt.state_dict())
        for k, st in enumerate(sd["state"].values()):  # saved as a tensor (as torch's step): made a number,
            assert count_tensor(st.get("adam_step", torch.tensor(0)))  # under geomopt's name or torch's
            if "adam_step" in st:
                n = st.pop("adam_step").item()
                st.update({"adam_step": n} if k % 2 else {"step": float(n)})
        opt.load_state_dict(sd)
        assert all(count_tensor(st.get("adam_step", torch.tensor(0))) for st in opt.state.values())
        opt.step(loss_closure(opt, w, b, x))


@INFOS
def test_deepcopy_copies_all_public_attrs(info):
    for i in inputs(info):
        _, opt = primed(info, i.kwargs, steps=3)
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}
        assert public == {k for k in pickle.loads(pickle.dumps(opt)).__dict__ if not k.startswith("_")}


# ------------------------------------------------------------ hooks

@INFOS
def test_state_dict_hooks(info):
    def pre(o):
        o.state["test"] = 1

    def post(o, sd):
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd

    opt = info.optim_cls([torch.rand(2, 3, requires_grad=True)])
    opt.register_state_dict_pre_hook(pre)
    assert opt.state_dict()["state"]["test"] == 1
    opt = info.optim_cls([torch.rand(2, 3, requires_grad=True)])
    opt.register_state_dict_post_hook(post)
    assert opt.state_dict()["ran_pre_hook"] is False
    opt.register_state_dict_pre_hook(pre)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_pre_hook"] is True


@INFOS
def test_load_state_dict_pre_hook_and_prepend(info):
    def set_lr(o, sd):
        sd["param_groups"][0]["lr"] = 0.002

    def replace(o, sd):
        mine = copy.deepcopy(sd)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    opt = info.optim_cls([torch.rand(2, 3, requires_grad=True)])
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(set_lr)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(replace, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002  # the prepended hook ran first


@INFOS
def test_load_state_dict_hooks_run_once_in_order(info):
    calls = []
    opt = info.optim_cls(list(weight_bias()))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre1"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre2"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre1", "pre2", "post"]


@INFOS
def test_step_hooks(info):
    seen = []
    opt = info.optim_cls([torch.tensor([1.0, 1.0])])
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    post = opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    opt.step()
    opt.step()
    assert seen == ["pre", "post"] * 2
    pre.remove()
    post.remove()
    opt.step()
    assert seen == ["pre", "post"] * 2


@INFOS
def test_step_all_hooks(info):
    data = []
    params = [torch.tensor([1.0, 1.0])]
    opt, other = info.optim_cls(params), torch.optim.SGD(params)
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
    try:
        for o in (opt, other):
            handles += [o.register_step_pre_hook(lambda o, a, k: data.append(1)),
                        o.register_step_post_hook(lambda o, a, k: data.append(2))]
        opt.step()
        other.step()
        opt.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    opt.step()
    assert data == [0, 1, 2, 5] * 3
