"""Fuzzing ``load_state_dict``: optimizer state dicts saved by several shipped specs and state
precisions, with values, types, keys, shapes and dtypes mutated (tests/checkpoint_mutants.py),
either load and then step to finite parameters and state, or are refused with a
:class:`CheckpointError` naming what was mutated, leaving parameters and optimizer state bit for
bit as they were; never another exception.

CI draws ``GEOMOPT_LOAD_FUZZ`` examples (default 40, a few seconds); ``GEOMOPT_LOAD_FUZZ=5000``
runs many more (hypothesis' seed: ``--hypothesis-seed``). The seeded, recorded run of the same
generator: ``python scripts/fuzz.py --n 0 --checkpoints 50000`` (tests/test_fuzz_pipeline.py runs a slice).
"""

from __future__ import annotations

import copy
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from geomopt.optim import CheckpointError
from checkpoint_mutants import SPECS, Drawn, base, finite, mutate
from test_load_validation import snapshot

N = int(os.environ.get("GEOMOPT_LOAD_FUZZ", "40"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(spec=st.sampled_from(SPECS), data=st.data())
def test_a_mutated_state_dict_loads_and_steps_finitely_or_is_refused_naming_it(spec, data):
    opt0, saved, grads = base(spec)
    opt = copy.deepcopy(opt0)
    sd = copy.deepcopy(saved)
    named: list = []
    choose = Drawn(data)
    for _ in range(choose.integer(1, 3)):
        named += mutate(choose, sd)
    before = snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except CheckpointError as err:
        event("refused")
        text = str(err)
        assert any(word in text for word in named), (named, text)
        assert "Traceback" not in text
        assert snapshot(opt) == before, named
        return
    event("loaded")
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            p.grad = grads[name].clone()
    opt.step()
    assert finite(opt), named
