"""One mutated optimizer checkpoint through ``load_state_dict`` and a step, and the contract it must keep.

Checkpoint mutant ``i`` of seed ``S`` (:func:`checkpoint_mutants.mutant` drawing from
``Seeded(S, i)``) is loaded into a copy of its spec's stepped optimizer, which then steps once on
finite gradients. The contract:

- the load either succeeds, and the step after it leaves parameters and every floating state
  tensor finite (``stepped``), or raises :class:`CheckpointError` naming what was mutated (the
  key, the rule or the tensor) and leaves parameters, state, param_groups and counters bit for bit
  as they were (``refused``);
- anything else is a finding: another exception from the load (``crash``) or from the step after
  a load (``step_crash``), a refusal that changed something (``refused_wrote``) or that names
  none of what was mutated (``refusal_unnamed``), non-finite values after the step (``nonfinite``),
  and a mutant that runs past :data:`fuzz_pipeline.HANG_S` seconds (``hang``).
"""

from __future__ import annotations

import copy
import time
import warnings

from geomopt.optim import CheckpointError

from checkpoint_mutants import Seeded, base, finite, mutant
from fuzz_pipeline import Hang, time_limit
from test_load_validation import snapshot

FINDINGS = ("crash", "step_crash", "refused_wrote", "refusal_unnamed", "nonfinite", "hang")


def run_checkpoint(seed: int, i: int) -> dict:
    """The record of checkpoint mutant ``i``: ``outcome`` is ``stepped``, ``refused`` or one of :data:`FINDINGS`."""
    out: dict = {"i": i}
    t0 = time.perf_counter()
    try:
        with time_limit(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load_and_step(out, seed, i)
    except Hang:
        out["outcome"] = "hang"
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def _load_and_step(out: dict, seed: int, i: int) -> None:
    spec, sd, named = mutant(Seeded(seed, i))
    out["spec"], out["named"] = spec, [str(w) for w in named]
    opt0, _, grads = base(spec)
    opt = copy.deepcopy(opt0)
    before = snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except CheckpointError as err:
        text = str(err)
        out["error"] = _error(err)
        if snapshot(opt) != before:
            out["outcome"] = "refused_wrote"
        elif "Traceback" in text or not any(word in text for word in out["named"]):
            out["outcome"] = "refusal_unnamed"
        else:
            out["outcome"] = "refused"
        return
    except Exception as err:  # noqa: BLE001 (the finding itself)
        out["outcome"], out["error"] = "crash", _error(err)
        return
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            p.grad = grads[name].clone()
    try:
        opt.step()
    except Exception as err:  # noqa: BLE001 (the finding itself)
        out["outcome"], out["error"] = "step_crash", _error(err)
        return
    out["outcome"] = "stepped" if finite(opt) else "nonfinite"
