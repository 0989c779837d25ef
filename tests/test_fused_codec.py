"""GeomOptimizer(fuse=True) with a flat rule's state in a lower precision: each piece's decode and
encode (block scales, code search, random bits) run as functions compiled by torch.compile
(inductor, on the CPU here) from the codec's own source. They store the eager step's bits: the same
parameters, bf16 values, codes, scales and corrections, chunk by chunk (pieces of every size, a
tensor whose size is no multiple of 256 kept float32), a checkpoint resumes bit for bit within
fuse=True, and a non-finite gradient leaves every value as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from test_state_chunks import ADAM, DTYPES, SIGN, _assert_same_run, _grads, _params, _same, _spec

import geomopt
from geomopt.optim.engine import flat
from geomopt.optim.persist.codes import BLOCK, flat_noise, noise, seed_of, signed

pytestmark = [pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning"),
              pytest.mark.filterwarnings("ignore::geomopt.RolesGuessedWarning")]

RULES = {"adam": (ADAM, None), "sign-nesterov": (SIGN, {"kind": "polyak", "alpha": 0.1, "nesterov": True})}


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks of 512 entries: a tensor of 3072 cut in six, small ones sharing a chunk, pieces of
    several sizes (256, 512, 768, 1024 entries: the compiled codec's dynamic sizes)."""
    monkeypatch.setattr(flat, "CHUNK", 2 * BLOCK)


def _run(spec: dict, fuse: bool, steps: int = 3):
    ps = _params()
    opt = geomopt.GeomOptimizer(ps, spec, fuse=fuse)
    for k in range(steps):
        _grads(ps, k)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_codec_stores_the_eager_steps_bits(dtype, rule):
    """Three steps (the first makes the state), eager against fuse=True: every parameter and every
    stored entry bit for bit; the compiled codec ran, and int8's 250-entry tensor kept float32."""
    spec = _spec(dtype, *RULES[rule])
    eager = _run(spec, fuse=False)
    fused = _run(spec, fuse=True)
    assert all(p.compiled for progs in fused[1].engine.programs for p in progs)
    assert not any(p.compiled for progs in eager[1].engine.programs for p in progs)
    _assert_same_run(eager, fused)
    ps, opt = fused
    stored = torch.bfloat16 if dtype == "bfloat16" else torch.uint8
    for name, p in ps:
        moments = [v for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq", "d")]
        keep = dtype != "bfloat16" and p.numel() % BLOCK  # no multiple of 256: float32 under int8
        assert moments and all(v.dtype == (torch.float32 if keep else stored) for v in moments), name
    moved = max((p.detach() - q).abs().max().item() for (_, p), (_, q) in zip(ps, _params()))
    assert moved > 1e-4  # the steps did something the comparison could miss


def test_a_checkpoint_resumes_bit_for_bit_within_fuse():
    """int8-ec Adam (codes, scales, corrections): two steps, saved, loaded into a fresh fuse=True
    optimizer; the next two steps store the same bits as the run that was not interrupted."""
    spec = _spec("int8-ec", ADAM)
    ps, opt = _run(spec, fuse=True, steps=2)
    qs = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ps]
    resumed = geomopt.GeomOptimizer(qs, spec, fuse=True)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in (2, 3):
        for params, o in ((ps, opt), (qs, resumed)):
            _grads(params, k)
            o.step()
    _assert_same_run((ps, opt), (qs, resumed))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8-ec"])
def test_a_nonfinite_gradient_leaves_the_compiled_codec_state_untouched(dtype):
    ps, opt = _run(_spec(dtype, ADAM), fuse=True, steps=2)
    was = {n: (p.detach().clone(), {k: copy.deepcopy(v) for k, v in opt.state[p].items()}) for n, p in ps}
    _grads(ps, 5)
    ps[0][1].grad.view(-1)[300] = float("inf")
    opt.step()
    for name, p in ps:
        assert _same(p, was[name][0]), name
        assert opt.state[p].keys() == was[name][1].keys()
        assert all(_same(opt.state[p][k], v) for k, v in was[name][1].items()), name
    assert sum(c["skipped"] for c in opt.engine.counters) == 1


def test_flat_noise_draws_noises_bits_from_tensor_seed_and_offset():
    """The compiled encode's random bits (seed and offset as tensors) against :func:`noise`'s for the
    same entries of a whole tensor, a seed above 2³¹ included (its int32 is negative)."""
    for seed in (seed_of("w", 3, "exp_avg"), (1 << 31) + 12345):
        whole = noise([seed], (1, 3000)).reshape(-1)
        part = flat_noise(torch.tensor(signed(seed), dtype=torch.int32), torch.tensor(768), 1024, "cpu")
        assert torch.equal(part, whole[768:1792])
        assert seed < 1 << 31 or signed(seed) < 0


def test_the_dispatcher_says_the_codec_is_compiled():
    text = geomopt.GeomOptimizer(_params(), _spec("int8", ADAM), fuse=True).describe()
    assert "flat · fused · compiled" in text and "fuse: each piece's decode" in text
    plain = geomopt.GeomOptimizer(_params(), _spec("float32", ADAM), fuse=True)
    assert not any(p.compiled for progs in plain.engine.programs for p in progs)  # float32 Adam: nothing to fuse
