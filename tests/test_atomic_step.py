"""A step never half-applies: a fault injected at every operator request of every shipped spec
leaves each tensor (parameter and optimizer state) either exactly as before the step or exactly
as one clean step leaves it, the committed ones are the ones the optimizer names, and calling
``step()`` again with the same gradients gives the bits of one clean step."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geomopt
from geomopt import GeomOptimizer
from geomopt.geometry import polynomial
from geomopt.optim.persist import state_codec
from geomopt.optim.persist.load_check import CheckpointError
from optim_helpers import gpt_batch, loss_of, tiny_gpt

SPECS = sorted(geomopt.shipped_specs())
EXAMPLES = sorted((geomopt.shipped_specs()["muon"].parent / "examples").glob("*.yaml"))
# state updated in place before a later request (Adam's moments, a stage's statistics, then the
# backward op), which no shipped spec has: the journal's cases
JOURNALED = {
    "adam-post": """geomopt: 1
name: adam-post
rules:
  - name: hidden
    match: {role: hidden}
    geometry: {kind: adam}
    post: [{kind: rms_match, target: input, eps: 1.0e-10}]
  - {name: rest, match: "**", geometry: {kind: adam}}
""",
    "normuon-ball": """geomopt: 1
name: normuon-ball
extends: normuon
rules:
  - name: hidden
    constraint: {kind: spectral_ball, radius: 2.0}
""",
}


class InjectedFault(RuntimeError):
    """The fault the tests inject at an operator request."""


def build(spec, **options):
    model = tiny_gpt(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = GeomOptimizer(model, spec, **options)
    return model, opt


def tensors(opt) -> dict:
    """name → (parameter, its state entries), for an optimizer or its copy."""
    return {n: (p, opt.state[p]) for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}


def grads_of(model, step: int) -> dict:
    """name → gradient of the loss on batch ``step``."""
    model.zero_grad(set_to_none=True)
    loss_of(model, gpt_batch(step)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def copy_with_grads(opt, grads: list):
    """A deep copy of ``opt`` (whose parameters carry no gradients) stepped with each of
    ``grads`` but the last, which it then holds. The copy's first step binds its state entries to
    the stacked buffers (a copy starts unbound), so the faulty step updates the state in place as
    a long run does."""
    twin = copy.deepcopy(opt)
    for k, g in enumerate(grads):
        for name, (p, _) in tensors(twin).items():
            p.grad = g[name].clone() if name in g else None
        if k < len(grads) - 1:
            twin.step()
    return twin


def same_state(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def snapshot(opt) -> dict:
    return {n: (p.detach().clone(), copy.deepcopy(s)) for n, (p, s) in tensors(opt).items()}


def requests_of(opt, grads: list) -> int:
    """How many operator requests the last step of ``opt`` over ``grads`` makes (on a copy)."""
    twin = copy_with_grads(opt, grads)
    run, count = twin.engine.executor.run, [0]

    def counting(requests):
        count[0] += len(requests)
        return run(requests)

    twin.engine.executor.run = counting
    twin.step()
    return count[0]


def inject(opt, at: int, after: bool = False) -> None:
    """Make the ``at``-th operator request of the next step raise :class:`InjectedFault`: before
    it runs, or ``after`` it ran (an operator that wrote what it writes, then failed)."""
    run, count = opt.engine.executor.run, [0]

    def faulty(requests):
        if count[0] <= at < count[0] + len(requests):
            if after:
                run(requests)
            raise InjectedFault(f"fault at request {at}")
        count[0] += len(requests)
        return run(requests)

    opt.engine.executor.run = faulty


def assert_one_clean_step(trial, clean, want: dict, at: int) -> None:
    """After a retry: no pending step, every tensor and its state as one clean step left them
    (``want``), and the step counts and counters of the clean optimizer ``clean``."""
    assert trial.pending_step is None
    for name, (p, state) in tensors(trial).items():
        assert torch.equal(p, want[name][0]), (name, at)
        assert same_state(state, want[name][1]), (name, at)
    assert [g["step"] for g in trial.param_groups] == [g["step"] for g in clean.param_groups]
    for mine, theirs in zip(trial.engine.counters, clean.engine.counters):
        assert mine["skipped"] == theirs["skipped"] and torch.equal(mine["fallbacks"], theirs["fallbacks"])
        assert torch.equal(mine["update_sq"], theirs["update_sq"]), at


def assert_before_or_after(trial, was: dict, want: dict, at: int) -> set:
    """Each tensor of ``trial`` and its state bit for bit as before the step (``was``) or after one
    clean step (``want``), after by the pending step's record; returns the names done."""
    pending = trial.pending_step
    done = set(pending["done"]) if pending else set()
    for name, (p, state) in tensors(trial).items():
        ref = want[name] if name in done else was[name]
        assert torch.equal(p, ref[0]), (name, at, name in done)
        assert same_state(state, ref[1]), (name, at, name in done)
    return done


def check_every_fault(opt, grads: list, after: bool = False) -> int:
    """Inject a fault at each request of the last step of ``opt`` over ``grads`` (before or
    ``after`` it runs); returns how many were injected."""
    clean = copy_with_grads(opt, grads)
    was = snapshot(clean)
    clean.step()
    want = snapshot(clean)
    n = requests_of(opt, grads)
    for at in range(n):
        trial = copy_with_grads(opt, grads)
        run = trial.engine.executor.run
        inject(trial, at, after)
        with pytest.raises(InjectedFault) as info:
            trial.step()
        done = assert_before_or_after(trial, was, want, at)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        if done:  # each rule with committed tensors is named, with its tensors or their count
            rules = {g["rule"]: [n for n in g["param_names"] if n in done] for g in trial.param_groups}
            for rule, names in rules.items():
                assert not names or f"rule '{rule}': {names[0]}" in notes, (rule, notes)
        # the retry applies only the rest: one clean step's bits and step counts
        trial.engine.executor.run = run
        trial.step()
        assert_one_clean_step(trial, clean, want, at)
    return n


@pytest.fixture(params=["muon-order", "deferred"])
def order(request, monkeypatch):
    """CPU runs torch Muon's op order, where each bucket steps whole in turn; off it, a step
    launches every bucket's forward op, then awaits the finiteness test, then writes (the
    deferred check CUDA runs), whose faults the first round meets before anything is written."""
    if request.param == "deferred":
        monkeypatch.setattr(polynomial, "_MUON_ORDER_DEVICES", ())
    return request.param


@pytest.mark.parametrize("after", [False, True], ids=["before-op", "after-op"])
@pytest.mark.parametrize("spec", SPECS + EXAMPLES + list(JOURNALED), ids=lambda s: getattr(s, "stem", s))
def test_a_fault_at_any_request_leaves_each_tensor_before_or_after_and_a_retry_completes_the_step(spec, order, after):
    model, opt = build(geomopt.parse_spec(JOURNALED[spec]) if spec in JOURNALED else spec)
    grads = [grads_of(model, 0), grads_of(model, 1)]
    first = check_every_fault(opt, grads[:1], after)  # the first step: state created
    steady = check_every_fault(opt, grads, after)  # a later step: state updated in place
    assert first + steady > 0 or all(  # a spec whose every rule runs on the flat path makes no request
        prog.variant == "flat" for progs in opt.engine.programs for prog in progs)


def test_the_exception_keeps_its_type_and_names_the_committed_and_the_interrupted_tensors():
    model, opt = build("muon")
    grads = [grads_of(model, 0)]
    n = requests_of(opt, grads)
    assert n >= 2
    opt = copy_with_grads(opt, grads)
    inject(opt, n - 1)
    with pytest.raises(InjectedFault) as info:
        opt.step()
    notes = "\n".join(info.value.__notes__)
    assert "applied in part" in notes and "not applied" in notes and "step() again" in notes
    pending = opt.pending_step
    assert pending["done"] and all(name in notes for name in pending["done"][:2])


def test_a_fault_before_anything_is_written_leaves_no_pending_step(monkeypatch):
    # the deferred check: the matrices' forward ops run before the elementwise rules write
    monkeypatch.setattr(polynomial, "_MUON_ORDER_DEVICES", ())
    model, opt = build("muon")
    opt = copy_with_grads(opt, [grads_of(model, 0)])
    opt.engine.dispatch(opt.param_groups)  # the programs follow the device's op order patched above
    assert opt.engine.deferred and "deferred behind the forward ops" in opt.describe()
    was = snapshot(opt)
    inject(opt, 0)
    with pytest.raises(InjectedFault) as info:
        opt.step()
    assert opt.pending_step is None and not getattr(info.value, "__notes__", [])
    for name, (p, state) in tensors(opt).items():
        assert torch.equal(p, was[name][0]) and same_state(state, was[name][1]), name


def test_an_interrupted_step_survives_a_checkpoint():
    model, opt = build("muon")
    grads = [grads_of(model, 0), grads_of(model, 1)]
    clean = copy_with_grads(opt, grads)
    clean.step()
    n = requests_of(opt, grads)
    opt = copy_with_grads(opt, grads)
    inject(opt, n - 1)
    with pytest.raises(InjectedFault):
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["geomopt"]["pending"]["done"] == opt.pending_step["done"]
    _, resumed = build("muon")
    with torch.no_grad():
        for (p, _), (q, _) in zip(tensors(opt).values(), tensors(resumed).values()):
            q.copy_(p)
            q.grad = p.grad.clone()
    resumed.load_state_dict(saved)
    assert resumed.pending_step == opt.pending_step
    resumed.step()
    for name, (p, state) in tensors(resumed).items():
        q, ref = tensors(clean)[name]
        assert torch.equal(p, q), name
        assert same_state(state, ref), name


def test_a_checkpoint_naming_tensors_this_optimizer_lacks_is_refused_before_anything_is_written():
    model, opt = build("muon")
    opt = copy_with_grads(opt, [grads_of(model, 0)])
    saved = copy.deepcopy(opt.state_dict())
    saved["geomopt"]["pending"] = {"done": ["no.such.weight"], "groups": [0]}
    with pytest.raises(CheckpointError, match="no.such.weight"):
        opt.load_state_dict(saved)
    saved["geomopt"]["pending"] = {"done": "lm_head.weight", "groups": [0]}
    with pytest.raises(CheckpointError, match="pending"):
        opt.load_state_dict(saved)
    assert opt.pending_step is None


# ---------------------------------------------------------------- faults outside operator requests

#: state in another precision: each bucket's state is encoded (which allocates) at its commit
PRECISION = """geomopt: 1
name: precision
rules:
  - name: hidden
    match: {{role: hidden}}
    geometry: {{kind: spectral, reference: {{kind: indicator}}, approx: {{kind: newton_schulz}}}}
    direction: {{kind: polyak, alpha: 0.1, nesterov: true}}
    state: {dtype}
  - name: rest  # a momentum as well, kept float32 where int8 does not quantize (a size not a multiple of 256)
    match: "**"
    geometry: {{kind: adam}}
    direction: {{kind: polyak, alpha: 0.5, nesterov: true}}
    state: {dtype}
"""
#: an elementwise rule whose map allocates after its momentum is formed (the norms): heavy ball,
#: whose first step copies the gradient
HEAVY_ISOTROPIC = """geomopt: 1
name: heavy-isotropic
rules:
  - name: all
    match: "**"
    geometry: {kind: isotropic, reference: {kind: log_barrier, eps: 1.0e-8}}
    direction: {kind: heavy_ball, momentum: 0.9}
"""
#: elementwise rules whose maps are barriers after a momentum: the power barrier's (h*)' allocates (the
#: flat path stages the new momentum and the map before any write), the log barrier's writes a
#: second scratch after Nesterov's look-ahead (it cannot write over its input)
BARRIER_MOMENTUM = """geomopt: 1
name: barrier-momentum
rules:
  - name: hidden
    match: {role: hidden}
    geometry: {kind: anisotropic, reference: {kind: power_barrier, kappa: 4.0, eps: 0.1}}
    direction: {kind: polyak, alpha: 0.1}
  - name: rest
    match: "**"
    geometry: {kind: anisotropic, reference: {kind: log_barrier, eps: 0.01}}
    direction: {kind: polyak, alpha: 0.1, nesterov: true}
"""
#: how many allocation points each case tries: a spread over the step (every one: GEOMOPT_FAULTS=all)
FAULTS = os.environ.get("GEOMOPT_FAULTS", "24")


class InjectedOutOfMemory(torch.OutOfMemoryError):
    """The out-of-memory error the tests raise where the step allocates."""


def allocates(func) -> bool:
    """Whether an ATen op makes a new tensor: one of its results aliases no input (not a view,
    an in-place or an ``out=`` op)."""
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in func._schema.returns)


class FaultAtAllocation(TorchDispatchMode):
    """Counts the ops that allocate and raises :class:`InjectedOutOfMemory` at the ``at``-th (−1:
    never): what a device out of memory does, wherever the step allocates."""

    def __init__(self, at: int = -1):
        super().__init__()
        self.at, self.count, self.hit = at, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if allocates(func):
            self.count += 1
            if self.count - 1 == self.at:
                self.hit = str(func)
                raise InjectedOutOfMemory(f"injected at {func}")
        return func(*args, **(kwargs or {}))


def check_faults(opt, grads: list, arm, points) -> int:
    """For each fault point in ``points``: a copy of ``opt`` over ``grads`` steps with the fault
    ``arm(trial, at)`` installed (a context manager); the step must raise it, leave each tensor
    as before the step or as one clean step leaves it (the committed ones), and a retry must give
    the bits and counts of one clean step. Returns how many points raised."""
    clean = copy_with_grads(opt, grads)
    was = snapshot(clean)
    clean.step()
    want = snapshot(clean)
    raised = 0
    for at in points:
        trial = copy_with_grads(opt, grads)
        try:
            with arm(trial, at):
                trial.step()
            continue  # past the step's last point
        except (InjectedFault, InjectedOutOfMemory):
            raised += 1
        assert_before_or_after(trial, was, want, at)
        trial.step()
        assert_one_clean_step(trial, clean, want, at)
    return raised


@contextlib.contextmanager
def encode_fails(trial, at: int):
    """The ``at``-th encoding of a bucket's state (:meth:`Codec.encode`) raises out of memory."""
    encode, calls = state_codec.Codec.encode, [0]

    def failing(self, values):
        if self.dtype != "float32":
            calls[0] += 1
            if calls[0] - 1 == at:
                raise InjectedOutOfMemory("out of memory while encoding the state")
        return encode(self, values)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_codec.Codec, "encode", failing)
        yield


@contextlib.contextmanager
def allocation_fails(trial, at: int):
    with FaultAtAllocation(at):
        yield


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "int8-ec"])
def test_a_fault_while_the_state_is_encoded_leaves_each_tensor_before_or_after(dtype, order):
    """Out of memory in the codec, at each bucket's encoding: the bucket's parameters, state and
    counters are as before the step (none half-written), and the retry gives one clean step's bits."""
    model, opt = build(geomopt.parse_spec(PRECISION.format(dtype=dtype)))
    grads = [grads_of(model, 0), grads_of(model, 1)]
    buckets = sum(1 for progs in opt.engine.programs for p in progs if p.variant == "batched")
    for steps in (grads[:1], grads):
        assert check_faults(opt, steps, encode_fails, range(buckets + 1)) == buckets


def spread(n: int) -> list:
    """The allocation points tried of a step making ``n``: all of them with GEOMOPT_FAULTS=all,
    else that many spread evenly (the last one always)."""
    if FAULTS == "all" or int(FAULTS) >= n:
        return list(range(n))
    k = int(FAULTS)
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def allocations(opt, grads: list) -> int:
    twin = copy_with_grads(opt, grads)
    with FaultAtAllocation() as mode:
        twin.step()
    return mode.count


@pytest.mark.parametrize("spec", [
    "int8", "bfloat16", "int8-ec",  # batched, the state encoded at each commit
    "muon",  # batched in-place writes, and the flat path with torch's fused AdamW kernel
    "sign-descent", "prox-muon-frobenius", "adamw-hybrid",  # flat blocks and scratch; a journaled prox
    "heavy-isotropic", "barrier-momentum",
])
def test_out_of_memory_at_any_allocation_leaves_each_tensor_before_or_after(spec, order):
    """Out of memory wherever a step allocates (every ATen op that makes a new tensor, counted by
    a dispatch mode): the step raises it, every tensor is as before the step or as one clean
    step leaves it, counters included (the update norm tracked), and a retry completes the step
    bit for bit."""
    texts = {d: PRECISION.format(dtype=d) for d in ("int8", "bfloat16", "int8-ec")}
    texts.update({"heavy-isotropic": HEAVY_ISOTROPIC, "barrier-momentum": BARRIER_MOMENTUM})
    parsed = geomopt.parse_spec(texts[spec]) if spec in texts else spec
    for track in (False, True):  # tracking the update runs every rule batched (no flat path)
        model, opt = build(parsed, track_update=track)
        assert track or spec in ("int8", "bfloat16", "int8-ec") or any(
            p.variant == "flat" for progs in opt.engine.programs for p in progs)
        grads = [grads_of(model, 0), grads_of(model, 1)]
        for steps in (grads[:1], grads):
            n = allocations(opt, steps)
            points = spread(n)
            # (a point past the end: a cache filled by the counting run, e.g. the int8 code table)
            assert check_faults(opt, steps, allocation_fails, points) >= len(points) // 2
