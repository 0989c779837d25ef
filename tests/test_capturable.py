"""``capturable=True``: a step makes no host synchronization, the first one included (counted at
the dispatcher and at the Python boundary), a non-finite gradient is skipped on the device leaving
every bit as it was, ``torch.compile(opt.step, fullgraph=True)`` captures the whole step as one
graph for every shipped spec and matches the eager step, and the results stay within rounding of
the default (host-checked) step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from optim_helpers import SHIPPED, gpt_batch, loss_of, tiny_gpt
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import geomopt

pytestmark = pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")

#: aten ops that read a device value on the host (a sync on CUDA), and Python conversions that do
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "equal")
SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


class HostReads(TorchDispatchMode):
    """Counts the host reads of device values made inside it (aten ops and Python conversions)."""

    def __init__(self):
        super().__init__()
        self.reads: list = []
        self.functions = _Functions(self.reads)

    def __enter__(self):
        self.functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNC_OPS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __init__(self, reads: list):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNC_METHODS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _pair(spec, **kw):
    models = [tiny_gpt(0), tiny_gpt(0)]
    return models, [geomopt.GeomOptimizer(models[0], spec, **kw), geomopt.GeomOptimizer(models[1], spec,
                                                                                       capturable=True, **kw)]


def _grads(models, step, poison=False):
    for m in models:
        for p in m.parameters():
            p.grad = None
        loss_of(m, gpt_batch(step)).backward()
        if poison:
            for p in m.parameters():
                p.grad.view(-1)[-1] = math.nan


def _snapshot(opt) -> list:
    out = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    out += [v.clone() if torch.is_tensor(v) else v for st in opt.state.values() for v in st.values()]
    out += [g["step"].clone() if torch.is_tensor(g["step"]) else g["step"] for g in opt.param_groups]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda p: p.stem)
def test_a_capturable_step_reads_nothing_on_the_host_skips_on_the_device_and_tracks_the_default(spec):
    models, (plain, captured) = _pair(str(spec))
    for step in range(5):
        _grads(models, step, poison=step == 3)
        plain.step()
        before = _snapshot(captured)
        with HostReads() as reads:
            captured.step()
        assert reads.reads == [], (step, reads.reads)  # the first step, which creates the state, too
        if step == 3:  # a NaN in every gradient: every bit of parameters, state and counts as it was
            assert _same(before[:-len(captured.param_groups)], _snapshot(captured)[:-len(captured.param_groups)])
            assert all(int(g["step"]) == 3 for g in captured.param_groups)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (spec.stem, (p - q).abs().max())
    assert [int(c["skipped"]) for c in captured.engine.counters] == [c["skipped"] for c in plain.engine.counters]
    assert all(int(g["step"]) == 4 for g in captured.param_groups)
    assert "check device" in captured.describe()


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda p: p.stem)
def test_torch_compile_captures_the_whole_step_as_one_graph(spec):
    """fullgraph=True fails on any graph break (a host read, an untraceable call); the eager
    backend runs the captured graph's own ops, so it equals the eager capturable step within the
    rounding of scalars passed as tensors (Dynamo does not specialize floats)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models, (eager, compiled) = _pair(str(spec))
    eager = geomopt.GeomOptimizer(models[0], str(spec), capturable=True)
    step = torch.compile(compiled.step, fullgraph=True, backend="eager")
    for k in range(4):
        _grads(models, k, poison=k == 2)
        eager.step()
        compiled.step() if k == 0 else step()
    assert counters["stats"]["unique_graphs"] == 1  # one capture, no recompilation
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6), (spec.stem, (p - q).abs().max())


@pytest.mark.parametrize("spec", ["muon", "adamw-hybrid"])
def test_inductor_compiles_the_step_and_matches_eager(spec):
    torch._dynamo.reset()
    models, (eager, compiled) = _pair(spec)
    eager = geomopt.GeomOptimizer(models[0], spec, capturable=True)
    step = torch.compile(compiled.step, fullgraph=True)
    for k in range(3):
        _grads(models, k)
        eager.step()
        compiled.step() if k == 0 else step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (spec, (p - q).abs().max())


def test_a_capturable_checkpoint_resumes_in_either_mode():
    models, (plain, captured) = _pair("muon")
    for k in range(3):
        _grads(models, k)
        plain.step()
        captured.step()
    sd = copy.deepcopy(captured.state_dict())
    twins = [copy.deepcopy(models[1]) for _ in range(2)]
    resumed = [geomopt.GeomOptimizer(m, "muon", capturable=flag) for m, flag in zip(twins, (True, False))]
    for opt in resumed:
        opt.load_state_dict(copy.deepcopy(sd))
    _grads([models[1], *twins], 3)
    captured.step()
    for opt in resumed:
        opt.step()
    for twin in twins:
        for p, q in zip(models[1].parameters(), twin.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("edit, message", [
    ({"direction": {"kind": "storm"}}, "storm direction"),
    ({"on_nonfinite": "raise"}, "on_nonfinite: raise"),
    ({"direction": {"kind": "polyak", "alpha": 0.05, "warmup_steps": 10, "warmup_alpha": 0.15}}, "momentum warmup"),
])
def test_what_a_capturable_step_cannot_do_is_refused_at_construction(edit, message):
    spec = {"geomopt": 1, "name": "s", "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                                                  **edit}]}
    with pytest.raises(ValueError, match=message):
        geomopt.GeomOptimizer(tiny_gpt(0), spec, capturable=True)


def test_a_schedule_under_the_compiled_step_recompiles_once_then_reads_lr_as_an_input():
    """A torch LR scheduler changes ``lr`` (a float) every step: Dynamo recompiles at the first
    change and then passes it as an input (automatic dynamic floats), so the compiled step follows
    the schedule as eager does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models, (eager, compiled) = _pair("muon")
    eager = geomopt.GeomOptimizer(models[0], "muon", capturable=True)
    step = torch.compile(compiled.step, fullgraph=True, backend="eager")  # before the scheduler wraps it
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (1 + k)) for o in (eager, compiled)]
    for k in range(6):
        _grads(models, k)
        eager.step()
        compiled.step() if k == 0 else step()
        for s in schedules:
            s.step()
    assert counters["stats"]["unique_graphs"] == 2
    assert compiled.param_groups[0]["lr"] == eager.param_groups[0]["lr"] < 0.005
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda p: p.stem)
def test_a_tensor_lr_under_a_scheduler_is_read_on_the_device(spec):
    """``lr`` a 0-d tensor (torch's form for capturable schedules: a scheduler ``fill_``s it), so a
    captured step (a CUDA graph replays fixed kernels with fixed scalars) follows the schedule: no
    host read after the first step, and the iterates track float lr under the same schedule (lr
    values a float32 holds exactly, so sign descent's signs of near-zero entries cannot flip on lr's
    own rounding)."""
    models, (plain, captured) = _pair(str(spec))
    for g, h in zip(plain.param_groups, captured.param_groups):
        h["lr"] = torch.tensor(g["lr"])
        g["lr"] = float(h["lr"])
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5 ** k) for o in (plain, captured)]
    for step in range(4):
        _grads(models, step)
        plain.step()
        with HostReads() as reads:
            captured.step()
        assert step == 0 or reads.reads == [], (step, reads.reads)
        for s in schedules:
            s.step()
    assert all(torch.is_tensor(g["lr"]) for g in captured.param_groups)
    assert float(captured.param_groups[0]["lr"]) == pytest.approx(plain.param_groups[0]["lr"])
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (spec.stem, (p - q).abs().max())


@pytest.mark.parametrize("spec", ["hyperball", "spectral-clip", "stiefel", "prox-muon-frobenius"])
def test_a_cuda_graph_capture_that_reaches_a_decomposition_is_refused_before_it_runs(spec, monkeypatch):
    """torch.linalg.eigh/svd read their error codes on the host, which a CUDA-graph capture forbids
    (a failed capture leaves the CUDA context unusable): the step raises with the reason before any
    decomposition is called, and records no pending step (in a capture nothing ran: the buckets
    before it were only recorded). On CPU the capture is simulated (``is_current_stream_capturing``),
    so the recorded buckets do run here; the GPU check (benchmarks/capture.py) shows the rest."""
    models, (_, captured) = _pair(spec)
    _grads(models, 0)
    captured.step()
    _grads(models, 1)

    def called(*args, **kwargs):
        raise AssertionError("a decomposition ran inside the capture")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for name in ("eigh", "svd", "svdvals", "eigvalsh"):
        monkeypatch.setattr(torch.linalg, name, called)
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA-graph capture"):
        captured.step()
    assert captured.pending_step is None


def test_a_tensor_lr_under_the_compiled_step_never_recompiles():
    """With ``lr`` a 0-d tensor the schedule is an input from the first call: one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models, (eager, compiled) = _pair("muon")
    eager = geomopt.GeomOptimizer(models[0], "muon", capturable=True)
    for opt in (eager, compiled):
        for g in opt.param_groups:
            g["lr"] = torch.tensor(g["lr"])
    step = torch.compile(compiled.step, fullgraph=True, backend="eager")
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5 ** k) for o in (eager, compiled)]
    for k in range(5):
        _grads(models, k)
        eager.step()
        compiled.step() if k == 0 else step()
        for s in schedules:
            s.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert float(compiled.param_groups[0]["lr"]) == float(eager.param_groups[0]["lr"]) == pytest.approx(0.02 * 0.5 ** 5)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ["muon", "adamw-hybrid"])
def test_torch_compile_from_the_first_step_creates_the_state_and_skips_on_the_device(spec):
    """``torch.compile(opt.step, fullgraph=True)`` from the very first call, with the spec's float
    lr: the step that creates the state keeps its finiteness flag on the device too (no guard on
    its value), so the state is created inside the graph, as torch's capturable Adam's is. A NaN
    gradient, on that first step and on a later one, leaves every bit of the parameters and state
    as it was; finite steps match the eager capturable step within the rounding of the scalars
    Dynamo passes as tensors (1e-6; inductor: 1e-5, ``test_inductor_compiles_the_step_and_matches_eager``).
    aot_eager, which runs AOTAutograd's graph as inductor gets it, keeps this test fast: inductor
    compiles C++ for about 50 s per graph on a 2-core CPU."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models = [tiny_gpt(0), tiny_gpt(0)]
    eager, compiled = (geomopt.GeomOptimizer(m, spec, capturable=True) for m in models)
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    for k in range(5):
        poison = k in (0, 3)
        _grads(models, k, poison=poison)
        before, params = _snapshot(compiled), [p.detach().clone() for p in models[1].parameters()]
        eager.step()
        step()
        if poison:  # every bit as it was (the first step creates the state: from zeros, its counts 0)
            assert all(torch.equal(p, q) for p, q in zip(params, models[1].parameters()))
            assert k == 0 or _same(before, _snapshot(compiled))
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-6), (spec, k, (p - q).abs().max())
    assert counters["stats"]["unique_graphs"] <= 2  # the step that creates the state, then the others
    for opt in (eager, compiled):
        assert [int(g["step"]) for g in opt.param_groups] == [3] * len(opt.param_groups)
        assert [int(c["skipped"]) for c in opt.engine.counters] == [2] * len(opt.param_groups)
        counts = {int(v) for st in opt.state.values() for key, v in st.items() if key == "adam_step"}
        assert counts == {3}  # Adam's count: the skipped first step left it at 0


def _state_values(opt) -> list:
    return [v for g in opt.param_groups for p in g["params"] for _, v in sorted(opt.state[p].items())
            if torch.is_tensor(v)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (NaN payloads, −0.0 and +0.0 told apart), or the tensor."""
    sizes = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.detach().cpu().view(sizes[t.dtype]) if t.dtype in sizes else t.detach().cpu()


@pytest.mark.parametrize("spec", ["adamw", "sign-descent"])
def test_a_capturable_step_has_the_default_steps_bits(spec):
    """Adam's rules through the same fused kernel (found_inf, the same lr and count values),
    Polyak's d with α·ok, the write with γ·ok rounded in float64 as the host's γ: parameters and
    state bit for bit the default step's, a skipped step (NaN) among them. (A batched Polyak rule
    reads its momentum ahead instead, in the op order of the default step on CUDA, not of torch
    Muon's on the CPU: the next test.)"""
    models, (plain, captured) = _pair(spec)
    for step in range(4):
        _grads(models, step, poison=step == 2)
        plain.step()
        captured.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(_bits(p), _bits(q))
    for a, b in zip(_state_values(plain), _state_values(captured), strict=True):
        assert torch.equal(_bits(a), _bits(b.to(a.device)))
    # Adam's rules (all but sign descent's) step flat, through the fused kernel
    assert ("variant: flat · fused · check device" in captured.describe()) == (spec != "sign-descent")


def _fixed_grads(models: list, step: int, poison: bool = False) -> None:
    """The same gradients (drawn in float32, whatever the models' dtype) for every model: the
    momentum then does not depend on the parameters."""
    gen = torch.Generator().manual_seed(100 + step)
    for ps in zip(*(m.parameters() for m in models)):
        g = torch.randn(ps[0].shape, generator=gen)
        if poison:
            g.view(-1)[-1] = math.nan
        for p in ps:
            p.grad = g.to(p.dtype)


@pytest.mark.parametrize("spec", ["muon", "adamw-hybrid", "normuon"])
def test_a_capturable_polyak_step_reads_ahead_within_float32_of_a_float64_reference(spec):
    """A capturable batched Polyak rule (not compiled) reads its momentum ahead: u = d.lerp(G, 1 −
    β²) from one selected, stacked copy of the gradients, one rounding where the default CPU step
    (torch Muon's op order) forms d⁺ and then g.lerp(d⁺, β); d ← d.lerp(G, α·ok) at the commit,
    the default step's op. With the same gradients every step (a NaN step among them) the momentum
    has the default step's bits, and the hidden matrices are as close to the default step in
    float64 as the float32 default step is (measured: 4.3e-8 against 4.2e-8 for muon, 8.1e-8
    against 9.0e-8 for adamw-hybrid, moves of 0.05 to 0.07): within 1.5 times its distance and
    2e-7."""
    models = [tiny_gpt(0), tiny_gpt(0), tiny_gpt(0, dtype=torch.float64)]
    start = [p.detach().clone() for p in models[2].parameters()]
    plain, captured, reference = (geomopt.GeomOptimizer(m, spec, capturable=k == 1) for k, m in enumerate(models))
    hidden = {n for progs in captured.engine.programs for p in progs if p.variant == "batched" for n in p.names}
    assert hidden and "direction ahead · check device" in captured.describe()
    for step in range(6):
        _fixed_grads(models, step, poison=step == 2)
        for opt in (plain, captured, reference):
            opt.step()
    assert [int(c["skipped"]) for c in captured.engine.counters] == [1] * len(captured.param_groups)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        for key, value in plain.state[p].items():
            if key == "d":
                assert torch.equal(_bits(value), _bits(captured.state[q][key]))
    errors = {"plain": 0.0, "captured": 0.0}
    for (name, r), x0, p, q in zip(models[2].named_parameters(), start, models[0].parameters(),
                                   models[1].parameters()):
        if name in hidden:
            assert (r - x0).abs().max() > 0.02  # it moved
            errors["plain"] = max(errors["plain"], (p.double() - r).abs().max().item())
            errors["captured"] = max(errors["captured"], (q.double() - r).abs().max().item())
    assert 0 < errors["captured"] <= min(1.5 * errors["plain"], 2e-7), errors


@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("spec", ["muon", "adamw-hybrid", "normuon", "sign-descent"])
def test_a_nan_in_one_gradient_skips_the_capturable_step_with_every_bit_kept(spec, fuse):
    """One NaN in one gradient (a hidden matrix's, or under sign descent any tensor's), on a step
    after the state exists: every bit of the parameters and the state as it was (every rule skips),
    the skip counted once in the rule of the non-finite gradient, no step count advanced, and the
    next step steps."""
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, spec, capturable=True, fuse=fuse)
    names = [n for progs in opt.engine.programs for p in progs if p.variant == "batched" for n in p.names]
    target = dict(model.named_parameters())[names[0] if names else "lm_head.weight"]
    for k in range(2):
        _grads([model], k)
        opt.step()
    _grads([model], 2)
    target.grad.view(-1)[3] = math.nan
    before = [_bits(t).clone() for t in _snapshot(opt) if torch.is_tensor(t)]
    opt.step()
    after = [_bits(t) for t in _snapshot(opt) if torch.is_tensor(t)]
    steps = len(opt.param_groups)
    assert all(torch.equal(a, b) for a, b in zip(before[:-steps], after[:-steps]))  # all but the groups' steps
    params = [p for g in opt.param_groups for p in g["params"]]
    rule = [any(p is target for p in g["params"]) for g in opt.param_groups]
    assert [int(c["skipped"]) for c in opt.engine.counters] == [int(r) for r in rule] and sum(rule) == 1
    assert [int(g["step"]) for g in opt.param_groups] == [2] * steps
    _grads([model], 3)
    opt.step()
    assert not torch.equal(_bits(target), before[next(i for i, p in enumerate(params) if p is target)])


@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "fused"])
def test_a_capturable_checkpoint_resumes_bit_for_bit(fuse):
    """A capturable run saved after three steps and loaded into a new optimizer (the same options)
    steps on with the uninterrupted run's bits: parameters and every state tensor."""
    models = [tiny_gpt(0)]
    opt = geomopt.GeomOptimizer(models[0], "muon", capturable=True, fuse=fuse)
    for k in range(3):
        _grads(models, k)
        opt.step()
    twin = copy.deepcopy(models[0])
    resumed = geomopt.GeomOptimizer(twin, "muon", capturable=True, fuse=fuse)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k in (3, 4):
        _grads([models[0], twin], k)
        opt.step()
        resumed.step()
    for p, q in zip(models[0].parameters(), twin.parameters()):
        assert torch.equal(_bits(p), _bits(q))
    for a, b in zip(_state_values(opt), _state_values(resumed), strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_an_interrupted_fused_capturable_step_restores_the_momentum_its_look_ahead_wrote(monkeypatch):
    """Under fuse a capturable step's compiled look-ahead writes d⁺ into the momentum in place
    (and d as it was into its journal, in the same loop): a fault after it, before the bucket
    commits (here: at the forward op's answer), leaves every tensor exactly as before the step or
    as one clean step leaves it (the pending step names the committed ones), and the retry with
    the same gradients gives one clean step's bits."""
    from geomopt.optim.engine import bucket_step

    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, "muon", capturable=True, fuse=True)
    _grads([model], 0)
    opt.step()
    grads = [{n: p.grad.clone() for n, p in model.named_parameters()}]
    _grads([model], 1)
    grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    def named(o) -> dict:
        return {n: (p, o.state[p]) for g in o.param_groups for n, p in zip(g["param_names"], g["params"])}

    def stepped(o):  # a copy's first step binds its state to the stacked buffers (as a long run's is)
        o = copy.deepcopy(o)
        for k, g in enumerate(grads):
            for name, (p, _) in named(o).items():
                p.grad = g[name].clone()
            if k == 0:
                o.step()
        return o

    clean, trial = stepped(opt), stepped(opt)
    was = {n: (_bits(p).clone(), {k: _bits(v).clone() for k, v in st.items() if torch.is_tensor(v)})
           for n, (p, st) in named(trial).items()}
    clean.step()
    want = {n: (_bits(p), {k: _bits(v) for k, v in st.items() if torch.is_tensor(v)})
            for n, (p, st) in named(clean).items()}

    class Fault(RuntimeError):
        pass

    on_forward = bucket_step.BucketJob.on_forward

    def faulty(self, answer):
        raise Fault("at the forward op's answer")

    monkeypatch.setattr(bucket_step.BucketJob, "on_forward", faulty)
    with pytest.raises(Fault):
        trial.step()
    done = set(trial.pending_step["done"])
    assert done and done != set(want)  # the flat rule committed, no bucket did
    for name, (p, st) in named(trial).items():
        ref = want[name] if name in done else was[name]
        assert torch.equal(_bits(p), ref[0]), name
        assert {k: _bits(v) for k, v in st.items() if torch.is_tensor(v)}.keys() == ref[1].keys()
        assert all(torch.equal(_bits(v), ref[1][k]) for k, v in st.items() if torch.is_tensor(v)), name
    monkeypatch.setattr(bucket_step.BucketJob, "on_forward", on_forward)
    trial.step()
    assert trial.pending_step is None
    for name, (p, st) in named(trial).items():
        assert torch.equal(_bits(p), want[name][0]), name
        assert all(torch.equal(_bits(v), want[name][1][k]) for k, v in st.items() if torch.is_tensor(v)), name


def test_a_skipped_capturable_adam_step_leaves_every_bit_the_first_one_included():
    """Every tensor of the catalogue's AdamW in one fused call: a NaN in one gradient and +∞ in
    another skip it whole (the kernel returns before any write), on the first step (the moments
    exist, zero, count 0) and later; the parameters keep every bit, −0.0 included."""
    model = tiny_gpt(0)
    with torch.no_grad():
        next(model.parameters()).view(-1)[:3] = torch.tensor([-0.0, 0.0, -1.5])
    opt = geomopt.GeomOptimizer(model, "adamw", capturable=True)
    params = list(model.parameters())

    def grads(step, poison):
        _grads([model], step)
        if poison:
            params[0].grad.view(-1)[5] = math.nan
            params[-1].grad.view(-1)[0] = math.inf

    before = [_bits(p).clone() for p in params]
    grads(0, True)
    opt.step()
    assert all(torch.equal(a, _bits(p)) for a, p in zip(before, params))
    assert all(torch.count_nonzero(v) == 0 for v in _state_values(opt))  # moments 0, count 0
    grads(1, False)
    opt.step()
    assert not torch.equal(before[0], _bits(params[0]))
    after = [_bits(p).clone() for p in params]
    state = [_bits(v).clone() for v in _state_values(opt)]
    grads(2, True)
    opt.step()
    assert all(torch.equal(a, _bits(p)) for a, p in zip(after, params))
    assert all(torch.equal(a, _bits(v)) for a, v in zip(state, _state_values(opt)))
    assert [int(c["skipped"]) for c in opt.engine.counters] == [2] and int(opt.param_groups[0]["step"]) == 1


@pytest.mark.parametrize("spec, tensor_lr", [("sign-descent", False), ("muon", False), ("muon", True),
                                             ("adamw-hybrid", False)],
                         ids=["sign-descent-float-lr", "muon-float-lr", "muon-tensor-lr", "adamw-hybrid-float-lr"])
def test_a_fused_capturable_step_compiles_whole_and_skips_with_every_bit(spec, tensor_lr):
    """``fuse=True`` with ``capturable=True``: the compiled loops (sign descent's whole flat step;
    muon's look-ahead, which writes d⁺ into the momentum in place, and its write-back) read the
    gradients as they are and select them by the device's flag inside. A NaN, on the first step (which
    creates the state) and on a later one, leaves every bit of parameters and state as it was;
    ``torch.compile(opt.step, fullgraph=True)`` over it (lr a float or a 0-d tensor) captures no
    graph after the second call and matches the fused capturable step run eagerly, which stays
    within float32 rounding of the unfused capturable step: 1e-5 both (inductor's lerp, as
    ``test_fused``; the outer compile inlines the inner compiled loops, which aot_eager runs as
    eager ops)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    models = [tiny_gpt(0), tiny_gpt(0), tiny_gpt(0)]
    plain = geomopt.GeomOptimizer(models[0], spec, capturable=True)
    eager, compiled = (geomopt.GeomOptimizer(m, spec, capturable=True, fuse=True) for m in models[1:])
    assert all(p.compiled for progs in compiled.engine.programs for p in progs if not p.fused)
    if tensor_lr:
        for opt in (plain, eager, compiled):
            for g in opt.param_groups:
                g["lr"] = torch.tensor(g["lr"])
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    graphs = 0
    for k in range(5):
        poison = k in (0, 3)
        _grads(models, k, poison=poison)
        before, params = _snapshot(compiled), [p.detach().clone() for p in models[2].parameters()]
        plain.step()
        eager.step()
        step()
        if k == 1:
            graphs = counters["stats"]["unique_graphs"]
        if poison:
            assert all(torch.equal(_bits(p), _bits(q)) for p, q in zip(params, models[2].parameters()))
            assert k == 0 or _same(before, _snapshot(compiled))
        for p, q in zip(models[1].parameters(), models[2].parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (spec, k, (p - q).abs().max())
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (spec, k, (p - q).abs().max())
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation after the step that creates the state
    for opt in (eager, compiled):
        assert [int(g["step"]) for g in opt.param_groups] == [3] * len(opt.param_groups)
        assert [int(c["skipped"]) for c in opt.engine.counters] == [2] * len(opt.param_groups)
    moved = max((p - tiny_gpt(0).state_dict()[n]).abs().max().item() for n, p in models[2].named_parameters())
    assert moved > 1e-3
