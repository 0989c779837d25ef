"""One mutated spec through the whole pipeline, and the contract it must keep.

parse (``geomopt.parse_spec``) → compile on every small model (MLP, CNN, GPT, a Hugging Face
Llama from a config, random init) → ``GeomOptimizer`` on one of them (mutant ``i`` takes model
``i mod 4``) → two steps with random finite gradients → one step with a NaN in one gradient.

The contract:

- the only exceptions are geomopt's own, :data:`OWN_ERRORS`: ``geomopt.SpecError`` (from parse,
  compile or the optimizer's plan) with well-formed diagnostics, and, on the step whose gradient
  is not finite only, ``NonFiniteGradientError`` (a rule's ``on_nonfinite: raise``);
- no hang: a mutant that runs past :data:`HANG_S` seconds fails (a SIGALRM interrupts it);
  mutants slower than :data:`SLOW_S` are reported, never asserted on;
- a refused compile or optimizer build leaves the model's parameters, buffers and modes bit for
  bit as they were;
- parameters are finite after the two finite steps, and the non-finite step leaves them as
  they were (but the tensors of a rule with ``on_nonfinite: off``, which step as torch's do; and
  where the NaN is in such a tensor, the tested rules see finite gradients and step).
  Exempt (``overflow_asked``, counted, not a finding): a spec holding a number above
  :data:`HUGE` in magnitude, whose step may grow past float32 by arithmetic alone (lr 1e30 with
  weight decay 0.01 multiplies X by 1 − 1e28 each step: 1e56·X after two). A scalar that no
  float32 can hold at all is refused at compile time (lint GO126), so it never gets here.
"""

from __future__ import annotations

import contextlib
import signal
import time
import warnings

import torch

import geomopt
from geomopt.models import GPT, MLP, GPTConfig, SmallCNN
from geomopt.optim.engine.nonfinite import NonFiniteGradientError
from geomopt.spec.diagnostics import LANGUAGE_CODES, SEVERITY_ORDER

from spec_mutants import mutant

# geomopt's own errors, and where each may come from (anything else is a finding)
OWN_ERRORS = {
    "parse": (geomopt.SpecError,),
    "compile": (geomopt.SpecError,),
    "build": (geomopt.SpecError,),
    "step": (),
    "nonfinite_step": (NonFiniteGradientError,),
}
HANG_S = 60  # a mutant past this is a hang (ordinary ones take well under a second)
SLOW_S = 5  # reported, not asserted
HUGE = 1e6  # a spec with a number beyond this may overflow float32 parameters as asked


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` in the code swallows it."""


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=16)
    return LlamaForCausalLM(cfg)


FACTORIES = {
    "mlp": lambda: MLP(d_in=8, width=16, depth=3, d_out=4),
    "cnn": lambda: SmallCNN(width=4),
    "gpt": lambda: GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)),
    "llama": _llama,
}


class Models:
    """Each model built once; :meth:`fresh` hands it back with its initial weights restored."""

    def __init__(self, names=tuple(FACTORIES)):
        torch.manual_seed(0)
        self.models = {name: FACTORIES[name]() for name in names}
        self.init = {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
                     for name, m in self.models.items()}

    def fresh(self, name):
        model = self.models[name]
        with torch.no_grad():
            model.load_state_dict(self.init[name])
        for p in model.parameters():
            p.grad = None
        return model


def check_diagnostics(err: geomopt.SpecError, text: str | None) -> None:
    """A SpecError's diagnostics are well formed (positions inside ``text`` where given: a
    compile error may point into an ``extends`` base)."""
    assert err.diagnostics, "SpecError without diagnostics"
    max_line = len(text.splitlines()) + 1 if text is not None else 10**9
    for d in err.diagnostics:
        assert d.severity in SEVERITY_ORDER, d
        assert isinstance(d.message, str) and d.message.strip(), d
        assert "Traceback" not in d.message and "__ANON" not in d.message, d
        assert isinstance(d.code, str) and d.code.startswith("GO"), d
        if d.code in LANGUAGE_CODES:
            assert d.name == LANGUAGE_CODES[d.code][0], d
        assert isinstance(d.line, int) and isinstance(d.col, int), d
        assert 0 <= d.line <= max_line and d.col >= 0, (d, max_line)


@contextlib.contextmanager
def time_limit(seconds: int = HANG_S, what: str = "the block"):
    """Raise :class:`Hang` inside the block once it has run ``seconds`` (SIGALRM; main thread only)."""

    def ring(signum, frame):
        raise Hang(f"{what} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _grads(model, gen: torch.Generator, nan: bool = False):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    if nan and params:
        params[0].grad.view(-1)[0] = float("nan")


def model_state(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[bool]]:
    """What an operation on ``model`` could write: a copy of every parameter and buffer, and each
    module's training mode."""
    return [t.detach().clone() for t in model.state_dict().values()], [m.training for m in model.modules()]


def same_state(a: tuple, b: tuple) -> bool:
    """Two :func:`model_state` results equal bit for bit (NaNs compare, -0.0 and 0.0 differ)."""
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a[0], b[0]))


def _stage(out: dict, stage: str, fn, text: str, model=None):
    """Run ``fn``; a geomopt error allowed at ``stage`` ends the mutant (recorded), any other is a
    finding, and so is a refusal that changed ``model`` (its parameters, buffers or modes)."""
    out["stage"] = stage
    before = model_state(model) if model is not None else None
    try:
        return True, fn()
    except Hang:
        raise
    except OWN_ERRORS[stage] as err:
        if isinstance(err, geomopt.SpecError):
            check_diagnostics(err, text if stage == "parse" else None)
        out["outcome"] = f"{stage}_refused"
        out["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        if before is not None and not same_state(before, model_state(model)):
            out["outcome"] = "refused_wrote"
        return False, None
    except Exception as err:  # noqa: BLE001 (the finding itself)
        out["outcome"] = "crash"
        out["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        return False, None


def run_mutant(seed: int, i: int, models: Models) -> dict:
    """The mutant's record: ``outcome`` is ``parse_refused``, ``compile_refused``, ``build_refused``,
    ``stepped``, or a finding (``crash``, ``hang``, ``nonfinite``, ``nonfinite_step_wrote``, ``bad_diagnostics``,
    ``refused_wrote``: a refused compile or build changed the model)."""
    level, fmt, text, ops = mutant(seed, i)
    out = {"i": i, "level": level, "fmt": fmt, "ops": ops}
    t0 = time.perf_counter()
    try:
        with time_limit(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _pipeline(out, fmt, text, models, i)
    except Hang:
        out["outcome"] = "hang"
    except AssertionError as err:
        out["outcome"] = "bad_diagnostics"
        out["error"] = str(err)[:300]
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def _pipeline(out: dict, fmt: str, text: str, models: Models, i: int) -> None:
    ok, spec = _stage(out, "parse", lambda: geomopt.parse_spec(text, fmt), text)
    if not ok:
        return
    for name, each in models.models.items():
        ok, _ = _stage(out, "compile", lambda m=each: geomopt.compile_spec(spec, m), text, each)
        if not ok:
            out["model"] = name
            return
    name = list(models.models)[i % len(models.models)]
    out["model"] = name
    model = models.fresh(name)
    ok, opt = _stage(out, "build", lambda: geomopt.GeomOptimizer(model, spec), text, model)
    if not ok:
        return
    gen = torch.Generator().manual_seed(i)

    def closure(nan=False):
        _grads(model, gen, nan)
        return torch.zeros(())

    for _ in range(2):
        ok, _ = _stage(out, "step", lambda: opt.step(closure), text)
        if not ok:
            return
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        asked = "overflow_asked" if _has_huge(spec.model_dump()) else "nonfinite"
        out["outcome"], out["error"] = asked, f"non-finite after two finite steps: {bad[:4]}"
        return
    before = [p.detach().clone() for p in model.parameters()]
    ok, _ = _stage(out, "nonfinite_step", lambda: opt.step(lambda: closure(nan=True)), text)
    if not ok and out["outcome"] == "crash":
        return
    out["nan_raised"] = not ok
    off = {pp.name for pp in opt.plan if pp.on_nonfinite == "off"}  # these step on as torch's optimizers do
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if named and named[0][0] in off:  # the NaN went to an untested tensor: for the tested rules a finite step
        out["outcome"] = "stepped"
        return
    if any(not torch.equal(a, p) and n not in off for a, (n, p) in zip(before, model.named_parameters())):
        out["outcome"], out["error"] = "nonfinite_step_wrote", "a step with a NaN gradient changed the parameters"
        return
    out["outcome"] = "stepped"


def _has_huge(data) -> bool:
    if isinstance(data, dict):
        return any(_has_huge(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_has_huge(v) for v in data)
    return isinstance(data, (int, float)) and not isinstance(data, bool) and abs(data) > HUGE


FINDINGS = ("crash", "hang", "nonfinite", "nonfinite_step_wrote", "bad_diagnostics", "refused_wrote")
