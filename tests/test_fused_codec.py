"""GeomOptimizer(fuse=True) with a flat rule's state in a lower precision, its codec compiled by
torch.compile (inductor, on the CPU here) from the codec's own source. A rule other than Adam decodes
and encodes each piece with compiled functions and stores the eager step's bits. An Adam rule steps
each piece stored in place in one compiled call (decode, Adam's arithmetic, write-back, encode): its
arithmetic is inductor's code for the same ops, within a few ulp of torch's fused AdamW kernel, so a
step from the same state stores the same codes within one (bf16 values within one ulp) and
parameters within float32 rounding, and it is one AdamW step in float64 on the decoded moments
(tests/test_state_chunks.py). Within fuse=True a checkpoint resumes bit for bit, a non-finite
gradient leaves every value as it was, and a schedule compiles nothing again."""

from __future__ import annotations

import copy

import pytest
import torch
from test_state_chunks import ADAM, DTYPES, SIGN, _assert_same_run, _grads, _params, _same, _spec

import geomopt
from geomopt.optim.engine import flat, fused_codec as tail
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_codec_stores_the_eager_steps_bits(dtype):
    """Three steps of sign descent with Nesterov momentum (the first makes the state), eager against
    fuse=True: every parameter and every stored entry bit for bit; the compiled codec ran, and int8's
    250-entry tensor kept float32."""
    spec = _spec(dtype, *RULES["sign-nesterov"])
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


def _spy(monkeypatch) -> list:
    """The pieces :class:`~geomopt.optim.engine.fused_codec.EncodedAdam` steps whole, (tensor size, piece size)."""
    calls: list = []
    call = tail.EncodedAdam.__call__

    def spy(self, x, g, targets, a, seeds):
        calls.append(x.numel())
        return call(self, x, g, targets, a, seeds)

    monkeypatch.setattr(tail.EncodedAdam, "__call__", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_encoded_adam_step_runs_whole_within_rounding_of_the_eager_step(dtype, monkeypatch):
    """Two eager steps make the state; a fuse=True optimizer loads it, and both take the third step
    with the same gradients. The fused step ran each piece stored in place whole (int8's 250-entry
    tensor, kept float32, the chunked way), and stored what the eager step stores within the rounding
    of inductor's arithmetic against torch's fused kernel: parameters and float32 moments within 2 ulp
    of their tensor's largest entry, block scales within 4 ulp, codes within one, bf16 values within
    one ulp."""
    spec = _spec(dtype, ADAM)
    ps, eager = _run(spec, fuse=False, steps=2)
    qs = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ps]
    fuse = geomopt.GeomOptimizer(qs, spec, fuse=True)
    fuse.load_state_dict(copy.deepcopy(eager.state_dict()))
    calls = _spy(monkeypatch)
    for params, o in ((ps, eager), (qs, fuse)):
        _grads(params, 2)
        o.step()
    whole = [p.numel() for _, p in ps if dtype == "bfloat16" or p.numel() % BLOCK == 0]
    assert sum(calls) == sum(whole) and len(calls) > len(whole)  # every entry once; the big tensor in pieces
    for (name, p), (_, q) in zip(ps, qs):
        assert _close(p, q), name
        a, b = eager.state[p], fuse.state[q]
        assert a.keys() == b.keys(), name
        for key in a:
            if key.endswith("_absmax"):
                assert _ulps(a[key], b[key]) <= 4, (name, key)
            elif a[key].dtype == torch.uint8 and not key.endswith("_ec"):
                assert (a[key].int() - b[key].int()).abs().max() <= 1, (name, key)
            elif a[key].dtype == torch.bfloat16:
                assert (a[key].view(torch.int16).int() - b[key].view(torch.int16).int()).abs().max() <= 1, (name, key)
            elif a[key].dtype == torch.float32:
                assert _close(a[key], b[key]), (name, key)
    moved = max((p.detach() - q).abs().max().item() for (_, p), (_, q) in zip(qs, _params()))
    assert moved > 1e-4


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 ``a`` and ``b`` within 2 ulp of ``a``'s largest magnitude (what a sum of a few roundings of
    the tensor's terms can move)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) <= 2 * torch.finfo(torch.float32).eps * float(a.abs().max())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between float32 ``a`` and ``b`` in units in the last place (both signs)."""
    ia, ib = (t.detach().contiguous().view(torch.int32).long() for t in (a, b))
    ia, ib = (torch.where(i < 0, -(2 ** 31) - i, i) for i in (ia, ib))  # monotone in the float's value
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_pieces_of_one_block_and_of_one_entry_step_whole(dtype, monkeypatch):
    """Tensors of one int8 block (256 entries: a piece of one row of blocks) and, under bf16, of one
    entry: three steps under fuse=True within rounding of the eager steps, every piece run whole."""
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(*s, generator=gen) for n, s in {"one": (256,), "two": (2, 256), "tiny": (1,)}.items()}

    def run(fuse: bool):
        ps = [(n, torch.nn.Parameter(x.clone())) for n, x in init.items()]
        opt = geomopt.GeomOptimizer(ps, _spec(dtype, ADAM), fuse=fuse)
        for k in range(3):
            _grads(ps, k)
            opt.step()
        return ps

    eager = run(False)
    calls = _spy(monkeypatch)
    fused = run(True)
    assert sum(calls) == 2 * sum(p.numel() for _, p in eager if dtype == "bfloat16" or p.numel() % BLOCK == 0)
    for (name, p), (_, q) in zip(eager, fused):
        assert float((p - q).detach().abs().max()) <= 1e-6 * float(p.detach().abs().max()), name


def test_a_schedule_compiles_nothing_again(monkeypatch):
    """int8 Adam under fuse=True with a new lr every step: after the second step (the first makes the
    state eagerly), no step compiles a graph, and the pieces ran whole."""
    from torch._dynamo.utils import counters

    ps = _params()
    opt = geomopt.GeomOptimizer(ps, _spec("int8", ADAM), fuse=True)
    calls = _spy(monkeypatch)
    graphs = []
    for k in range(5):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (1 + k)
        _grads(ps, k)
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert calls and graphs[1] == graphs[-1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checkpoint_resumes_bit_for_bit_within_fuse(dtype):
    """Adam (bf16 values; codes, scales, corrections): two steps, saved, loaded into a fresh fuse=True
    optimizer; the next two steps store the same bits as the run that was not interrupted."""
    spec = _spec(dtype, ADAM)
    ps, opt = _run(spec, fuse=True, steps=2)
    qs = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ps]
    resumed = geomopt.GeomOptimizer(qs, spec, fuse=True)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in (2, 3):
        for params, o in ((ps, opt), (qs, resumed)):
            _grads(params, k)
            o.step()
    _assert_same_run((ps, opt), (qs, resumed))


@pytest.mark.parametrize("dtype", DTYPES)
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
    assert "flat · fused · compiled" in text and "fuse: each piece's decode, Adam's arithmetic" in text
    sign = geomopt.GeomOptimizer(_params(), _spec("int8", *RULES["sign-nesterov"]), fuse=True).describe()
    assert "one kernel per moment" in sign and "Adam's arithmetic" not in sign
    plain = geomopt.GeomOptimizer(_params(), _spec("float32", ADAM), fuse=True)
    assert not any(p.compiled for progs in plain.engine.programs for p in progs)  # float32 Adam: nothing to fuse
