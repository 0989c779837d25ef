"""GeomOptimizer(fuse=True): the elementwise tail compiled by torch.compile (inductor, on the CPU
here) steps as the eager step does, to within float32 rounding of the momentum; a schedule compiles
nothing again; a non-finite gradient leaves every value as it was; the choice is the dispatcher's
and says so."""

from __future__ import annotations

import math

import pytest
import torch
from optim_helpers import tiny_gpt
from test_capturable import _grads  # every model's gradients of one batch (NaN-poisoned on request)

import geomopt
from geomopt.optim.engine.fused import write_product

SGD_NESTEROV = {"geomopt": 1, "name": "sgd-nesterov", "defaults": {"lr": 0.05, "weight_decay": 0.1},
                "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                           "direction": {"kind": "polyak", "alpha": 0.1, "nesterov": True}}]}
PROX_MUON = {"geomopt": 1, "name": "prox-muon", "defaults": {"lr": 0.02, "weight_decay": 0.1},
             "rules": [{"name": "hidden", "match": {"ndim": 2}, "geometry": {"kind": "spectral", "reference": {
                 "kind": "power_barrier", "kappa": 4.0, "eps": 0.00105}, "approx": {"kind": "polar_express"}},
                 "constraint": {"kind": "proximal_decay", "lam": 0.1},
                 "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True}},
                 {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}, "lr": 0.01}]}
SIGN_DECAY = {"geomopt": 1, "name": "sign-decay", "defaults": {"lr": 0.01, "weight_decay": 0.1},
              "rules": [{"name": "all", "match": "**", "geometry": {"kind": "anisotropic",
                                                                     "reference": {"kind": "indicator"}},
                         "direction": {"kind": "polyak", "alpha": 0.1}}]}


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles its own functions (torch's recompile limit is per code object)."""
    torch._dynamo.reset()
    yield


def _pair(spec):
    models = [tiny_gpt(0), tiny_gpt(0)]
    return models, [geomopt.GeomOptimizer(models[0], spec), geomopt.GeomOptimizer(models[1], spec, fuse=True)]


def _gap(a, b) -> float:
    """The largest |difference| over two optimizers' parameters and momenta."""
    gaps = [(p - q).abs().max().item() for p, q in zip(a.param_groups[0]["params"] + a.param_groups[-1]["params"],
                                                       b.param_groups[0]["params"] + b.param_groups[-1]["params"])]
    gaps += [(a.state[p]["d"] - b.state[q]["d"]).abs().max().item()
             for ga, gb in zip(a.param_groups, b.param_groups) for p, q in zip(ga["params"], gb["params"])
             if "d" in a.state[p]]
    return max(gaps)


@pytest.mark.parametrize("spec, tol", [("sign-descent", 1e-6), (SIGN_DECAY, 1e-6), (SGD_NESTEROV, 1e-6),
                                       ("muon", 1e-5), (PROX_MUON, 1e-5)],
                         ids=["sign-descent", "sign-decay", "sgd-nesterov", "muon", "prox-muon"])
def test_the_fused_step_tracks_the_eager_step_within_float32_rounding(spec, tol):
    """Five steps under a learning rate that changes every step (the coefficients are graph
    inputs): parameters and momenta stay within a few float32 ulps of the eager step's (inductor
    rounds its lerp as its own code does). muon's and prox-muon's iterations run in the folded form
    under fuse (torch Muon's op order eagerly on the CPU) and amplify an ulp of their input u:
    their bound is ten times wider."""
    models, (eager, fused) = _pair(spec)
    assert any(p.compiled for progs in fused.engine.programs for p in progs)
    assert not any(p.compiled for progs in eager.engine.programs for p in progs)
    # muon's last product writes X (fused.write_product); prox-muon's prox comes between them
    assert any(p.product for progs in fused.engine.programs for p in progs) is (spec == "muon")
    for step in range(5):
        step_scheduled(models, (eager, fused), step)
        assert _gap(eager, fused) <= tol, step
    moved = max((p - tiny_gpt(0).state_dict()[n]).abs().max().item() for n, p in models[1].named_parameters())
    assert moved > 1e-3  # the steps did something the comparison could miss


@pytest.mark.parametrize("spec", [SIGN_DECAY, "muon", PROX_MUON], ids=["sign-decay", "muon", "prox-muon"])
def test_a_schedule_compiles_nothing_again(spec):
    """After the first two steps (the first starts the momentum: its own graph), a learning rate
    and a momentum coefficient changed at every step run the same compiled code (the flat tail;
    a bucket's look-ahead and its write-back, with a prox or without)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    models, (_, fused) = _pair(spec)
    models = models[1:]
    for step in range(2):
        _grads(models, step)
        fused.step()
    frames = counters["stats"]["unique_graphs"]
    for step in range(2, 6):
        _grads(models, step)
        for group in fused.param_groups:
            group["lr"] *= 0.5
            if "alpha" in group:
                group["alpha"] = 0.1 + 0.01 * step
        fused.step()
    assert counters["stats"]["unique_graphs"] == frames > 0


@pytest.mark.parametrize("spec", ["sign-descent", "muon", PROX_MUON], ids=["sign-descent", "muon", "prox-muon"])
def test_a_non_finite_gradient_leaves_the_fused_step_untouched(spec):
    models, (_, fused) = _pair(spec)
    _grads(models[1:], 0)
    fused.step()
    assert_a_poisoned_step_skips(fused, models[1:])


def step_scheduled(models: list, opts: tuple, step: int) -> None:
    """One batch's gradients for every model, then each optimizer's step with its lr decayed by 0.9
    (a schedule: the compiled regions take it as an input and compile nothing again)."""
    _grads(models, step)
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.9
        opt.step()


def assert_a_poisoned_step_skips(opt, models: list) -> None:
    """A step on NaN-poisoned gradients leaves every parameter and state tensor of ``opt`` (stepping
    ``models[0]``) bit for bit as it was, and is counted skipped."""
    before = [p.detach().clone() for p in models[0].parameters()]
    state = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    _grads(models, 1, poison=True)
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, models[0].parameters()))
    assert all(torch.equal(a, b) for a, b in
               zip(state, [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]))
    assert sum(opt.diagnostics()[g["rule"]]["skipped"] for g in opt.param_groups) > 0


def test_the_dispatcher_says_what_is_compiled_and_compiles_capturable_steps_with_the_flag_inside():
    model = tiny_gpt(0)
    text = geomopt.GeomOptimizer(model, "muon", fuse=True).describe()
    assert "batched · in-place · compiled" in text and "fuse: the look-ahead read row by row in one pass" in text
    sign = geomopt.GeomOptimizer(model, "sign-descent", fuse=True).describe()
    assert "flat · foreach · compiled" in sign
    captured = geomopt.GeomOptimizer(model, "sign-descent", fuse=True, capturable=True)
    assert all(p.compiled for progs in captured.engine.programs for p in progs)
    assert "flat · foreach · compiled · check device" in captured.describe()
    assert "(compiled: selected inside the loop, no copy of G)" in captured.describe()
    hidden = geomopt.GeomOptimizer(model, "muon", fuse=True, capturable=True).describe()
    assert "batched · in-place · compiled · direction rows · check device" in hidden
    adam = geomopt.GeomOptimizer(model, "adamw-hybrid", fuse=True)
    assert not any(p.compiled for progs in adam.engine.programs for p in progs if p.variant == "flat")


def test_the_compiled_look_ahead_writes_the_new_momentum_and_u_in_one_pass_as_float64_does():
    """fused.lookahead_rows: d⁺ = d + α(g − d) into a new tensor and u = g + (1 − α)(d⁺ − g), the
    old d left as it is, within two float32 ulps of the float64 values (and of the eager unit's
    two lerps, polyak_lookahead_rows)."""
    from geomopt.optim.engine import fused
    from geomopt.optim.units.directions import polyak_lookahead_rows
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(3, 16, 24, generator=gen)
    gs = [torch.randn(16, 24, generator=gen) for _ in range(3)]
    before = d.clone()
    for alpha in (0.05, 0.3):
        u, new = torch.empty_like(d), torch.empty_like(d)
        fused.lookahead_rows(u, new, d, gs, alpha)
        g64, d64 = torch.stack(gs).double(), d.double()
        new64 = d64 + alpha * (g64 - d64)
        u64 = g64 + (1 - alpha) * (new64 - g64)
        ulp = 2 * torch.finfo(torch.float32).eps
        assert torch.allclose(new.double(), new64, rtol=ulp, atol=ulp)
        assert torch.allclose(u.double(), u64, rtol=ulp, atol=ulp)
        eager = polyak_lookahead_rows(torch.empty_like(d), d, gs, alpha)
        assert torch.allclose(u, eager, rtol=ulp, atol=ulp)
        assert torch.equal(d, before)


def test_the_compiled_prox_write_back_is_the_float64_prox_of_the_decayed_step():
    """fused.prox_tail: X⁺ = (X(1 − γλ_wd) + c·S)/(1 + γλ) (proximal_decay) written into X, within
    float32 rounding of float64; a radius of 0 (nothing projects) writes Y itself."""
    from geomopt.geometry.prox import backward
    from geomopt.optim.engine import fused
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, PROX_MUON, fuse=True)
    pp = next(pp for plans in opt.engine.plans for pp in plans if pp.constraint is not None)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 12, generator=gen) for _ in range(2)]
    steps = [torch.randn(8, 12, generator=gen) for _ in range(2)]
    gamma, wd, coef, rho = 0.02, 0.1, -0.05, 1.5
    for radius in (rho, None):
        ys = [x.clone() for x in xs]
        fused.run(fused.compiled_prox(pp.decay, True, pp.geometry, pp.constraint, radius), [], [ys], [steps],
                  fused.scalar(1 - gamma * wd, xs[0]), fused.scalar(coef, xs[0]), fused.scalar(gamma, xs[0]))
        for x, s, y in zip(xs, steps, ys):
            y64 = x.double() * (1 - gamma * wd) + coef * s.double()
            if radius is not None:  # the backward op itself, in float64, is the closed form
                prox = backward(y64, gamma, pp.geometry, pp.constraint, radius=rho)[0]
                y64 = y64 / (1 + gamma * pp.constraint.lam)
                assert torch.allclose(prox, y64, rtol=1e-15, atol=0)
            assert torch.allclose(y.double(), y64, rtol=4e-7, atol=4e-7)


def test_the_folded_iteration_is_the_polynomial_map_and_replaces_torch_muons_order_only_inside_folded():
    """Inside polynomial.folded() the CPU runs the folded form (no pre-normalization pass, no
    transposed copy of a tall matrix): its result is p_k ∘ … ∘ p_1 applied to the singular values
    of D/(‖D‖_F + ε) (float64 SVD), within float32 rounding, on wide and tall matrices; outside it
    the CPU keeps torch Muon's op order (another rounding of the same map)."""
    from geomopt.geometry import polynomial
    from geomopt.geometry.prenorm import default_prenormalize
    coeffs = [(3.4445, -4.7750, 2.0315)] * 5
    cfg = default_prenormalize("newton_schulz")
    gen = torch.Generator().manual_seed(2)
    for shape in ((3, 16, 40), (3, 40, 16)):
        x = torch.randn(*shape, generator=gen)
        assert polynomial.muon_order(x.device)
        eager = polynomial.odd_quintic_iteration(x.clone(), coeffs, prenorm=cfg)
        with polynomial.folded():
            assert not polynomial.muon_order(x.device)
            out = polynomial.odd_quintic_iteration(x.clone(), coeffs, prenorm=cfg)
        assert polynomial.muon_order(x.device)
        assert torch.equal(out, polynomial._folded_iteration(x, coeffs, cfg, 1.0, torch.float32))
        x64 = x.double()
        x64 = x64 / (torch.linalg.matrix_norm(x64, keepdim=True) + 1e-7)
        uu, sigma, vh = torch.linalg.svd(x64, full_matrices=False)
        ref = uu @ torch.diag_embed(polynomial.compose_polynomials(coeffs, sigma)) @ vh
        assert (out.double() - ref).abs().max() < 2e-5
        assert (eager.double() - ref).abs().max() < 2e-5
        assert not torch.equal(out, eager)


def test_the_first_factor_folds_the_pre_normalization_and_the_scale_into_one_compiled_pass():
    """fused.first_factor: C₀ = scale·f·(aI + b·f²A + c·f⁴A²) from A and A² (f from tr A = ‖D‖²_F:
    frobenius 1/(‖D‖ + ε), max 1/max(‖D‖, ε)) within float32 rounding of the float64 formula, tr A
    recorded per matrix; the iteration with it (the fused form) is the float64 polynomial map of
    D's singular values times the scale, on wide and tall matrices; other coefficients and scales
    compile nothing again (graph inputs)."""
    from torch._dynamo.utils import counters
    from geomopt.geometry import polynomial
    from geomopt.optim.engine import fused
    from geomopt.spec.geometries import FrobeniusPrenorm, MaxPrenorm
    gen = torch.Generator().manual_seed(3)
    shapes = ((3, 16, 40), (2, 40, 16))
    xs = [torch.randn(*shape, generator=gen) * 3 for shape in shapes]
    frames = None
    for abc, scale in (((3.4445, -4.7750, 2.0315), 1.0), ((2.0, -1.5, 0.5), 0.7)):
        for cfg in (FrobeniusPrenorm(), MaxPrenorm()):
            for x in xs:
                x64 = x.double()
                a64 = x64.mT @ x64 if x.shape[-2] > x.shape[-1] else x64 @ x64.mT
                sq = (x64 ** 2).sum((-2, -1))
                norm = sq.sqrt()
                f = (1 / (norm + 1e-7) if cfg.kind == "frobenius" else 1 / norm.clamp(min=1e-7))[:, None, None]
                a, b, c = abc
                ref = scale * f * (a * torch.eye(a64.shape[-1], dtype=torch.float64) + b * f ** 2 * a64
                                   + c * f ** 4 * a64 @ a64)
                gram = a64.float()
                traces: list = []
                c0 = fused.first_factor(gram, gram @ gram, abc, scale, cfg, traces=traces)
                assert torch.allclose(c0.double(), ref, rtol=1e-5, atol=1e-5)
                assert len(traces) == 1 and torch.allclose(traces[0].double(), sq, rtol=1e-6)
                coeffs = [abc] + [(3.4445, -4.7750, 2.0315)] * 4
                with polynomial.folded(fused.first_factor):
                    out = polynomial.odd_quintic_iteration(x.clone(), coeffs, prenorm=cfg, scale=scale)
                uu, sigma, vh = torch.linalg.svd(x64 * f, full_matrices=False)
                mapped = scale * uu @ torch.diag_embed(polynomial.compose_polynomials(coeffs, sigma)) @ vh
                assert (out.double() - mapped).abs().max() < 2e-5
        if frames is None:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames > 0


def _skipped(opt) -> int:
    return sum(int(opt.diagnostics()[g["rule"]]["skipped"]) for g in opt.param_groups)


@pytest.mark.parametrize("capturable", [False, True], ids=["fused", "capturable-fused"])
@pytest.mark.parametrize("where", ["hidden", "flat"])
@pytest.mark.parametrize("spec", ["muon", "adamw-hybrid", "normuon"])
def test_a_nan_in_one_gradient_skips_the_fused_step_and_keeps_every_bit(spec, where, capturable):
    """A NaN in one entry of one gradient (a hidden matrix's, tested by its bucket's iteration, or
    a flat rule's tensor's, tested by the sum) skips the whole step: parameters, state and step
    counts keep every bit, the skip is counted once, and the next step steps; under
    ``on_nonfinite: raise`` the step raises with every bit kept. Fused, the step waits for the test
    behind the forward ops and reads no hidden gradient for it; capturable, the device's flag."""
    from test_capturable import _same, _snapshot
    from geomopt.optim.engine.nonfinite import NonFiniteGradientError
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, spec, fuse=True, capturable=capturable)
    assert opt.engine.deferred is not capturable
    assert ("reads tr A of the iteration's first Gram matrix" in opt.describe()) is not capturable
    batched = {n for progs in opt.engine.programs for p in progs if p.variant == "batched" for n in p.names}
    params = dict(model.named_parameters())
    target = next(n for n in params if (n in batched) == (where == "hidden"))
    for step in range(2):
        _grads([model], step)
        opt.step()
    before, skipped = _snapshot(opt), _skipped(opt)
    _grads([model], 2)
    params[target].grad.view(-1)[3] = math.nan
    opt.step()
    assert _same(before, _snapshot(opt)) and _skipped(opt) == skipped + 1
    if not capturable:  # a capturable step cannot raise (its flag stays on the device)
        for group in opt.param_groups:
            group["on_nonfinite"] = "raise"
        with pytest.raises(NonFiniteGradientError, match=target.replace(".", r"\.")):
            opt.step()
        assert _same(before, _snapshot(opt)) and _skipped(opt) == skipped + 1
        for group in opt.param_groups:
            group["on_nonfinite"] = "skip"
    _grads([model], 3)
    opt.step()
    assert not torch.equal(params[target], before[list(params).index(target)])


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_last_product_accumulates_into_x_as_float64_does(tall, layout):
    """fused.write_product: X ← X·keep + coef·F·Xₖ (tall: X·keep + coef·Xₖ·F) per matrix, written
    through each parameter's view (a transposed one too: a Conv1D's operators' layout), against
    the same arithmetic in float64."""
    torch.manual_seed(0)
    b, m, n = 3, (48 if tall else 16), (16 if tall else 48)
    k = min(m, n)
    factor, iterate = torch.randn(b, k, k), torch.randn(b, m, n)
    stored = [torch.randn(m, n) if layout == "contiguous" else torch.randn(n, m) for _ in range(b)]
    xs = [x if layout == "contiguous" else x.mT for x in stored]
    before = [x.double().clone() for x in xs]
    keep, coef = 0.99, -0.02
    write_product(xs, (factor, iterate, tall), keep, coef)
    for i, (x, x0) in enumerate(zip(xs, before)):
        f, it = factor[i].double(), iterate[i].double()
        want = x0 * keep + coef * (it @ f if tall else f @ it)
        assert (x.double() - want).abs().max() <= 1e-6 * want.abs().max()
        assert x.data_ptr() == (stored[i].data_ptr())  # in place, through the view


@pytest.mark.parametrize("scale", [1e12, 1e-20, 1.0])
def test_a_fused_step_on_gradients_of_any_scale_is_the_eager_step(scale):
    """The first factor's hook squares the un-normalized Gram matrix A: where A² would overflow
    (‖D‖_F past about 2e9 in float32) or sink into the subnormals (‖D‖_F below about 1e-5), the
    barrier sees tr A out of range and that bucket's op runs again in the folded form's own
    scaling, so the fused step is the eager one at every scale (hooked, the first would make C₀ = 0)."""
    models = [tiny_gpt(0), tiny_gpt(0)]
    opts = [geomopt.GeomOptimizer(models[0], "muon"), geomopt.GeomOptimizer(models[1], "muon", fuse=True)]
    start = [p.detach().clone() for p in models[0].parameters()]
    for step in range(2):
        _grads(models, step)
        for m in models:
            for p in m.parameters():
                p.grad.mul_(scale)
        for opt in opts:
            opt.step()
    hidden = {n for progs in opts[1].engine.programs for p in progs if p.variant == "batched" for n in p.names}
    for (name, p), q, p0 in zip(models[0].named_parameters(), models[1].parameters(), start):
        if name in hidden:
            moved = (p - p0).abs().max()
            assert moved > 0 and (p - q).abs().max() <= 1e-4 * moved, name


def test_the_first_factors_range_is_where_the_hooked_factor_holds_float32_precision():
    """fused.in_range: inside it (tr A up to √max/4 and down to 16k·√(tiny/ε)) the hooked first
    factor C₀ = f·(aI + b·f²A + c·f⁴A²) from the float32 A and A² is the float64 one to float32's
    precision; far past its top A² overflows and C₀ is wrong (which the barrier's check avoids)."""
    from geomopt.geometry.polynomial import first_factor_into
    from geomopt.geometry.prenorm import prenorm_factor
    from geomopt.optim.engine.fused import in_range
    from geomopt.spec.geometries import FrobeniusPrenorm
    torch.manual_seed(0)
    k, cfg, (a, b, c) = 16, FrobeniusPrenorm(), (3.4445, -4.7750, 2.0315)
    d0 = torch.randn(2, k, 40, dtype=torch.float64)
    info = torch.finfo(torch.float32)
    lo, hi = 16 * k * (info.tiny / info.eps) ** 0.5, info.max ** 0.5 / 4

    def hooked(trace: float) -> tuple:
        d = d0 / (d0 * d0).sum(dim=(-2, -1), keepdim=True).sqrt() * trace ** 0.5
        gram = d @ d.mT
        out, sq = torch.empty(2, k, k), torch.empty(2)
        first_factor_into(out, sq, gram.float(), gram.float() @ gram.float(), a, b, c, 1.0, prenorm=cfg)
        f = prenorm_factor(gram.diagonal(dim1=-2, dim2=-1).sum(-1), cfg)[:, None, None]
        want = f * (a * torch.eye(k, dtype=torch.float64) + b * f ** 2 * gram + c * f ** 4 * gram @ gram)
        err = ((out.double() - want).abs().amax(dim=(-2, -1)) / want.abs().amax(dim=(-2, -1))).max().item()
        return bool(in_range(sq, gram.float()).all()), err

    for trace in (hi / 2, lo * 2, 1.0):
        inside, err = hooked(trace)
        assert inside and err <= 1e-6, (trace, err)
    assert hooked(hi * 4)[0] is False and hooked(lo / 4)[0] is False
    inside, err = hooked(hi * 1e3)
    assert not inside and err > 0.5


@pytest.mark.filterwarnings("ignore::geomopt.geometry.dtypes.BF16Warning")  # bf16 on purpose
def test_the_last_product_writes_x_only_where_the_iteration_runs_in_xs_dtype():
    """addmm_ takes one dtype: a Newton–Schulz iteration in bf16 on float32 parameters casts its
    result, so its program does not claim the last product (describe() tells what runs)."""
    def spec(dtype):
        return {"geomopt": 1, "name": "t", "defaults": {"lr": 0.02, "weight_decay": 0.1}, "rules": [
            {"name": "hidden", "match": {"name": "**.weight", "ndim": 2},
             "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True},
             "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "scale": "muon_original",
                          "approx": {"kind": "newton_schulz", "steps": 5, "dtype": dtype}}},
            {"name": "rest", "match": "**", "geometry": {"kind": "adam"}}]}

    def claims(dtype):
        opt = geomopt.GeomOptimizer(tiny_gpt(0), spec(dtype), fuse=True)
        return any(p.product for progs in opt.engine.programs for p in progs), opt.describe()

    product, text = claims("float32")
    assert product and "last product into X" in text
    product, text = claims("bfloat16")
    assert not product and "last product into X" not in text
