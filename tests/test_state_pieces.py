"""A batched bucket's encoded Polyak momentum stepped in groups of whole matrices
(:mod:`geomopt.optim.engine.encoded_rows`): the same bits as decoding the bucket whole (muon,
normuon's post-stages, adamw-hybrid's prox; with and without Nesterov; bfloat16, int8, int8-ec), a
checkpoint resumes bit for bit, a non-finite gradient leaves everything as it was, and the step's
peak of live tensor bytes (benchmarks/memory.py's dispatch tally) stays within 1.1× the float32
state's, which decoding the bucket whole does not."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.optim.engine import encoded_rows
from geomopt.optim.engine.encoded_rows import EncodedMomentum
from geomopt.optim.persist import state_codec
from geomopt.optim.persist.codes import BLOCK
from script_loader import load_script
from test_state_chunks import _same

pytestmark = [pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning"),
              pytest.mark.filterwarnings("ignore::geomopt.RolesGuessedWarning")]

DTYPES = ["bfloat16", "int8", "int8-ec"]
NS = {"kind": "newton_schulz"}
SPECS = {
    "muon": dict(approx=NS),
    "muon-plain": dict(approx=NS, nesterov=False),
    "normuon": dict(approx=NS, post=[{"kind": "second_moment", "axis": "row", "beta2": 0.95},
                                     {"kind": "rms_match"}]),
    "adamw-hybrid": dict(approx={"kind": "polar_express"}, constraint={"kind": "proximal_decay", "lam": 0.1}),
}


def _spec(dtype: str, approx: dict, nesterov: bool = True, post=None, constraint=None) -> dict:
    hidden = {"name": "hidden", "match": {"role": "hidden"}, "lr": 0.02, "weight_decay": 0.1, "state": dtype,
              "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": approx},
              "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": nesterov}}
    if post:
        hidden["post"] = post
    if constraint:
        hidden["constraint"], hidden["weight_decay"] = constraint, 0.0
    rest = {"name": "rest", "match": "**", "geometry": {"kind": "adam", "betas": [0.9, 0.95]}, "lr": 1e-3,
            "state": dtype}
    return {"geomopt": 1, "name": "pieces", "rules": [hidden, rest]}


def _model() -> torch.nn.Module:
    """Three hidden 256×256 matrices (one bucket) between an input and an output layer."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 256),
                               torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))


def _grads(model: torch.nn.Module, k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _run(spec: dict, steps: int = 3):
    model = _model()
    opt = geomopt.GeomOptimizer(model, spec)
    for k in range(steps):
        _grads(model, k)
        opt.step()
    return model, opt


def _assert_same(one, other) -> None:
    (m, opt), (m2, opt2) = one, other
    for (name, p), q in zip(m.named_parameters(), m2.parameters()):
        assert _same(p, q), name
        assert opt.state[p].keys() == opt2.state[q].keys(), name
        for key in opt.state[p]:
            assert _same(opt.state[p][key], opt2.state[q][key]), (name, key)


def _whole(monkeypatch) -> None:
    """The bucket's momentum decoded whole (the path groups replace)."""
    monkeypatch.setattr(EncodedMomentum, "take", staticmethod(lambda *a: None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPECS))
def test_groups_of_matrices_give_the_bits_of_the_bucket_decoded_whole(name, dtype, monkeypatch):
    """Groups of one matrix and codec ranges of one block against the bucket decoded and encoded
    whole: the same parameters, codes, scales and corrections after 3 steps (the first creates the
    momentum; the next two step it encoded)."""
    spec = _spec(dtype, **SPECS[name])
    calls = []
    commit = EncodedMomentum.commit
    monkeypatch.setattr(EncodedMomentum, "commit", lambda self: calls.append(self.shape) or commit(self))
    monkeypatch.setattr(state_codec, "CHUNK", BLOCK)  # a 256×256 matrix is 256 blocks: a group of one
    grouped = _run(spec)
    assert state_codec.row_groups(3, 256 * 256) == [(0, 1), (1, 2), (2, 3)]
    assert calls.count((3, 256, 256)) == 2  # the bucket's two encoded steps went through the groups
    monkeypatch.undo()
    _whole(monkeypatch)
    whole = _run(spec)
    _assert_same(grouped, whole)
    stored = torch.bfloat16 if dtype == "bfloat16" else torch.uint8
    assert grouped[1].state[grouped[0][2].weight]["d"].dtype == stored


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_group_of_the_whole_stack_gives_the_same_bits(dtype, monkeypatch):
    """Groups of several matrices (the default chunk holds the three) against groups of one."""
    spec = _spec(dtype, NS)
    whole = _run(spec)
    assert state_codec.row_groups(3, 256 * 256) == [(0, 3)]
    monkeypatch.setattr(state_codec, "CHUNK", BLOCK)
    _assert_same(whole, _run(spec))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checkpoint_resumes_bit_for_bit(dtype):
    spec = _spec(dtype, NS)
    m, opt = _run(spec)
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    resumed = geomopt.GeomOptimizer(m2, spec)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for model, o in ((m, opt), (m2, resumed)):
        _grads(model, 3)
        o.step()
    _assert_same((m, opt), (m2, resumed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nonfinite_gradient_leaves_the_bucket_and_its_encoded_momentum_untouched(dtype):
    m, opt = _run(_spec(dtype, NS), steps=2)
    was = {n: (p.detach().clone(), copy.deepcopy(opt.state[p])) for n, p in m.named_parameters()}
    _grads(m, 5)
    m[2].weight.grad[3, 7] = float("nan")
    opt.step()
    for name, p in m.named_parameters():
        assert _same(p, was[name][0]), name
        assert opt.state[p].keys() == was[name][1].keys()
        for key, v in was[name][1].items():
            assert _same(opt.state[p][key], v), (name, key)
    assert sum(c["skipped"] for c in opt.engine.counters) == 1


def test_an_exception_in_the_forward_op_leaves_the_encoded_momentum_as_it_was(monkeypatch):
    """A failure after the groups formed u (in the forward op): nothing was written, the stored
    momentum is the same tensors with the same bits."""
    m, opt = _run(_spec("int8", NS), steps=2)
    p = m[2].weight
    was = {k: v.clone() for k, v in opt.state[p].items()}
    ids = {k: id(v) for k, v in opt.state[p].items()}
    x = p.detach().clone()
    from geomopt.optim.engine import requests as bucket_requests

    def fail(*a, **k):
        raise RuntimeError("forward op failed")

    monkeypatch.setattr(bucket_requests, "forward", fail)
    _grads(m, 4)
    with pytest.raises(RuntimeError, match="forward op failed"):
        opt.step()
    assert _same(p, x)
    assert {k: id(v) for k, v in opt.state[p].items()} == ids
    assert all(_same(opt.state[p][k], v) for k, v in was.items())


# ------------------------------------------------------------------------------ the step's peak

memory = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py", "memory_bench")


def test_the_tally_counts_new_storages_while_they_live_and_the_state_freed():
    held = torch.zeros(1000)  # 4000 bytes alive before
    keep = [held]
    with memory.PeakTally(held=keep) as tally:
        a = torch.empty(1000)  # +4000
        b = a.mul(2)  # +4000: 8000
        a.add_(1)  # in place: nothing new
        v = b[10:]  # a view: nothing new
        del a  # −4000
        keep.clear()
        del held  # the state freed: −4000
        c = torch.ones(250)  # +1000
    assert tally.peak == 8000
    assert tally.live == 4000 - 4000 + 1000
    del b, v, c


def _steady_peak(spec: dict) -> int:
    """The tally's peak over the third step (the first two create the state)."""
    model, opt = _run(spec, steps=2)
    _grads(model, 2)
    with memory.PeakTally(held=memory.state_tensors(opt)) as tally:
        opt.step()
    return tally.peak


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_encoded_step_peaks_within_a_tenth_of_the_float32_states(dtype, monkeypatch):
    """Muon over a bucket of three 256×256 matrices and an Adam rest: the encoded step's peak of live
    tensor bytes is at most 1.1× the float32 state's; decoding the bucket whole (a float32 copy of
    its momentum through Newton–Schulz, three 256 KiB matrices) exceeds it."""
    base = _steady_peak(_spec("float32", NS))
    assert base > 0
    peak = _steady_peak(_spec(dtype, NS))
    assert peak <= 1.1 * base, (peak, base)
    _whole(monkeypatch)
    assert _steady_peak(_spec(dtype, NS)) > 1.1 * base


def test_the_groups_are_whole_matrices_within_a_chunk():
    chunk = state_codec.CHUNK
    assert state_codec.row_groups(5, chunk // 2) == [(0, 2), (2, 4), (4, 5)]
    assert state_codec.row_groups(3, chunk * 2) == [(0, 1), (1, 2), (2, 3)]  # a row larger: one at a time
    assert encoded_rows.KEY == "d"


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_fused_step_steps_an_encoded_batched_momentum_as_the_eager_one(dtype):
    """``fuse=True`` runs the compiled look-ahead on each group of an encoded momentum (d⁺ into a
    scratch of the group's size, u from it): the parameters track the eager step's within float32
    rounding, and the stored momentum decodes to the eager one's."""
    out = {}
    for fuse in (False, True):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec(dtype, NS), fuse=fuse)
        for k in range(3):
            _grads(model, k)
            opt.step()
        out[fuse] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(out[False], out[True]))
    assert any(not torch.equal(a, b) for a, b in zip(out[False], _model().parameters()))  # it stepped
