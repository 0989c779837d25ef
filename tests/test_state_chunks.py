"""Low-precision state stepped in pieces: an elementwise rule with its state in bfloat16, int8 or
int8-ec steps on the flat path chunk by chunk (moments decoded into the workspace, the float32
path's arithmetic, encoded back), and a batched bucket's state is encoded and decoded piece by
piece. Pieces change no bit (against the same step in one piece), the flat step is one Adam step
on the decoded moments (float64 reference), a non-finite gradient leaves every tensor untouched,
and a checkpoint resumes bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import geomopt
from geomopt.optim.engine import flat
from geomopt.optim.persist import state_codec
from geomopt.optim.persist.codes import BLOCK
from geomopt.optim.persist.state_codec import decode_entry

pytestmark = [pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning"),
              pytest.mark.filterwarnings("ignore::geomopt.RolesGuessedWarning")]  # Linear layers: hidden

DTYPES = ["bfloat16", "int8", "int8-ec"]
ADAM = {"kind": "adam", "betas": [0.9, 0.95]}
SIGN = {"kind": "anisotropic", "reference": {"kind": "indicator"}}  # sign descent
SPECTRAL = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}


def _spec(dtype: str, geometry: dict, direction: dict | None = None) -> dict:
    rule = {"name": "all", "match": "**", "geometry": geometry, "lr": 1e-3, "weight_decay": 0.1, "state": dtype}
    if direction:
        rule["direction"] = direction
    rules = [rule]
    if geometry["kind"] == "spectral":  # matrices only; the rest Adam in the same precision
        rules = [dict(rule, match={"role": "hidden"}), dict(rule, name="rest", geometry=ADAM, direction=None)]
        rules[1].pop("direction")
    return {"geomopt": 1, "name": "chunks", "rules": rules}


def _params(seed: int = 0) -> list:
    """Tensors of several sizes: a multiple of 256 larger than a chunk (cut inside), small ones (several in
    one chunk), one whose size is no multiple of 256 (int8 keeps its state float32)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"big": (12, 256), "w": (4, 256), "v": (2, 384), "b": (250,), "c": (3, 256)}
    return [(n, torch.nn.Parameter(torch.randn(*s, generator=gen))) for n, s in shapes.items()]


def _grads(ps: list, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * torch.logspace(-3, 0, p.numel()).reshape(p.shape)


def _run(spec: dict, steps: int = 3, fuse: bool = False):
    ps = _params()
    opt = geomopt.GeomOptimizer(ps, spec, fuse=fuse)
    for k in range(steps):
        _grads(ps, k)
        opt.step()
    return ps, opt


def _same(a, b) -> bool:
    """Bit for bit, NaN payloads included."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[a.dtype]
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    return torch.equal(a, b)


def _assert_same_run(one, other) -> None:
    (ps, opt), (qs, opt2) = one, other
    for (name, p), (_, q) in zip(ps, qs):
        assert _same(p, q), name
        st, st2 = opt.state[p], opt2.state[q]
        assert st.keys() == st2.keys(), name
        for key in st:
            assert _same(st[key], st2[key]), (name, key)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry, direction", [
    (ADAM, None), (SIGN, {"kind": "polyak", "alpha": 0.1, "nesterov": True}),
    ({"kind": "euclidean"}, {"kind": "heavy_ball", "momentum": 0.9}),
], ids=["adam", "sign-polyak", "heavy-ball"])
def test_a_chunked_flat_step_equals_one_chunk_bit_for_bit(dtype, geometry, direction, monkeypatch):
    """Chunks of 512 entries (a tensor of 3072 cut in six, the small ones sharing chunks) against one
    chunk holding everything: the same parameters, codes, scales and corrections."""
    spec = _spec(dtype, geometry, direction)
    whole = _run(spec)
    assert all(p.variant == "flat" for progs in whole[1].engine.programs for p in progs)
    monkeypatch.setattr(flat, "CHUNK", 2 * BLOCK)
    assert max(sum(b - a for _, a, b in c) for c in flat.encoded_chunks([p.numel() for _, p in _params()],
                                                                          flat.CHUNK)) == 2 * BLOCK
    chunked = _run(spec)
    _assert_same_run(whole, chunked)
    stored = {torch.bfloat16} if dtype == "bfloat16" else {torch.uint8}
    assert stored <= {v.dtype for st in chunked[1].state.values() for v in st.values() if torch.is_tensor(v)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batched_bucket_encoded_in_pieces_equals_one_piece_bit_for_bit(dtype, monkeypatch):
    """A spectral rule's momentum (batched: a bucket of same-shape matrices) encoded and decoded in
    pieces of 256 entries against one piece of the whole bucket."""
    spec = _spec(dtype, SPECTRAL, {"kind": "polyak", "alpha": 0.1})
    model = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # noqa: E731

    def run():
        torch.manual_seed(0)
        m = model()
        opt = geomopt.GeomOptimizer(m, spec)
        assert any(p.variant == "batched" for progs in opt.engine.programs for p in progs)
        for k in range(3):
            gen = torch.Generator().manual_seed(k)
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return list(m.named_parameters()), opt

    whole = run()
    monkeypatch.setattr(state_codec, "CHUNK", BLOCK)
    _assert_same_run(whole, run())


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_flat_encoded_step_is_one_adam_step_on_the_decoded_moments(dtype, fuse):
    """The fourth step against AdamW in float64 from the decoded moments: parameters within 2 ulp,
    and the stored moments decode to the reference's within the codec's rounding; eagerly and under
    fuse=True (each piece decoded, stepped and encoded by one compiled call)."""
    ps, opt = _run(_spec(dtype, ADAM), fuse=fuse)
    before = {n: (p.detach().double().clone(), decode_entry(copy.deepcopy(opt.state[p]))) for n, p in ps}
    _grads(ps, 3)
    opt.step()
    b1, b2, eps, lr, wd, k = 0.9, 0.95, 1e-8, 1e-3, 0.1, 4
    for name, p in ps:
        x0, st = before[name]
        g = p.grad.double()
        m = b1 * st["exp_avg"].double() + (1 - b1) * g
        v = b2 * st["exp_avg_sq"].double() + (1 - b2) * g * g
        x = x0 * (1 - lr * wd) - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps)
        ulp = torch.finfo(torch.float32).eps * float(x.abs().max())
        assert float((p.detach().double() - x).abs().max()) <= 2 * ulp, name
        after = decode_entry(opt.state[p])
        # bf16: a relative 2⁻⁷; int8(-ec): half the map's coarsest gap (0.05 at the top) of the block's scale
        tol = 2 ** -7 * m.abs() if dtype == "bfloat16" else 0.05 * m.abs().max()
        assert ((after["exp_avg"].double() - m).abs() <= tol + 1e-12).all(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nonfinite_gradient_leaves_the_flat_encoded_state_untouched(dtype):
    ps, opt = _run(_spec(dtype, SIGN, {"kind": "polyak", "alpha": 0.1}), steps=2)
    was = {n: (p.detach().clone(), {k: copy.deepcopy(v) for k, v in opt.state[p].items()}) for n, p in ps}
    _grads(ps, 5)
    ps[1][1].grad.view(-1)[7] = float("nan")
    opt.step()
    for name, p in ps:
        assert _same(p, was[name][0]), name
        assert opt.state[p].keys() == was[name][1].keys()
        for key, v in was[name][1].items():
            assert _same(opt.state[p][key], v), (name, key)
    assert sum(c["skipped"] for c in opt.engine.counters) == 1


class _Largest(TorchDispatchMode):
    """The most entries of a tensor any op creates (a new storage, not a view or an in-place result)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
               and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in ins:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steady_flat_encoded_step_allocates_a_chunk_not_a_tensor(dtype, monkeypatch):
    """Once the state holds the rule's precision, the stored entries are written in place: no tensor of
    a moment's size is made (only the chunks' scratch: the codec's widest slot holds two words per
    entry), whatever the largest tensor's size."""
    monkeypatch.setattr(flat, "CHUNK", 2 * BLOCK)
    ps, opt = _run(_spec(dtype, ADAM), steps=2)
    _grads(ps, 7)
    with _Largest() as seen:
        opt.step()
    assert seen.most <= 2 * flat.CHUNK < max(p.numel() for _, p in ps)  # the codec's widest slot: 2 per entry


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checkpoint_of_the_flat_encoded_path_resumes_bit_for_bit(dtype):
    spec = _spec(dtype, ADAM)
    ps, opt = _run(spec)
    qs = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ps]
    resumed = geomopt.GeomOptimizer(qs, spec)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for params, o in ((ps, opt), (qs, resumed)):
        _grads(params, 3)
        o.step()
    _assert_same_run((ps, opt), (qs, resumed))


def test_chunks_cover_every_entry_once_and_cut_tensors_at_whole_blocks():
    sizes = [3000, 256, 100, 1280, 7]
    chunks = flat.encoded_chunks(sizes, 1024)
    assert all(sum(b - a for _, a, b in c) <= 1024 for c in chunks)
    seen = {i: [] for i in range(len(sizes))}
    for c in chunks:
        for i, a, b in c:
            seen[i].append((a, b))
            assert a % BLOCK == 0  # a cut inside a tensor lies between its int8 blocks
    for i, ranges in seen.items():
        assert [r for r in sorted(ranges)] == ranges and ranges[0][0] == 0 and ranges[-1][1] == sizes[i]
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))


def test_the_program_says_which_encoded_rules_step_flat_and_why_the_others_do_not():
    ps = _params()
    text = geomopt.GeomOptimizer(ps, _spec("int8", ADAM)).describe()
    assert "variant: flat · fused" in text and "state int8: the moments decoded chunk by chunk" in text
    iso = {"kind": "isotropic", "reference": {"kind": "indicator"}}
    text = geomopt.GeomOptimizer(_params(), _spec("int8", iso, {"kind": "polyak", "alpha": 0.1})).describe()
    assert "state int8: decoded to float32 and encoded again per bucket (isotropic: its norms read whole tensors)" \
        in text
