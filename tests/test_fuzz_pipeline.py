"""Mutated specs through the whole pipeline: parse → compile on four small models → GeomOptimizer →
two steps with random gradients → one with a NaN (the contract: tests/fuzz_pipeline.py); mutated
optimizer checkpoints through ``load_state_dict`` and a step (the contract: tests/fuzz_checkpoints.py).

CI runs a slice of ``GEOMOPT_FUZZ`` spec mutants (default 500, seed 0; about 70 mutants/s on one
core of a quiet machine) and of ``GEOMOPT_FUZZ_CHECKPOINTS`` checkpoint mutants (default 300). The
recorded run, writing the outcome file: ``python scripts/fuzz.py --n 50000 --checkpoints 50000
--seed 0 --workers 1 --out benchmarks/results/fuzz.json``.
"""

from __future__ import annotations

import collections
import math
import os

import pytest
import torch

import geomopt
from geomopt.optim.engine.nonfinite import NonFiniteGradientError
from checkpoint_mutants import SPECS, Seeded
from checkpoint_mutants import mutant as checkpoint_mutant
from fuzz_checkpoints import FINDINGS as CHECKPOINT_FINDINGS, run_checkpoint
from fuzz_pipeline import FINDINGS, HANG_S, OWN_ERRORS, Models, model_state, run_mutant, same_state
from spec_mutants import DSL_TEXTS, YAML_TEXTS, mutant

N = int(os.environ.get("GEOMOPT_FUZZ", "500"))
N_CHECKPOINTS = int(os.environ.get("GEOMOPT_FUZZ_CHECKPOINTS", "300"))
SEED = int(os.environ.get("GEOMOPT_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def models():
    return Models()


def test_generator_is_deterministic_and_varied():
    runs = [[mutant(SEED, i) for i in range(200)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert mutant(SEED, 0) != mutant(SEED + 1, 0)
    levels = collections.Counter((level, fmt) for level, fmt, _, _ in runs[0])
    assert {level for level, _ in levels} == {"struct", "token", "text", "mixed"}
    assert {fmt for _, fmt in levels} == {"yaml", "dsl"}
    assert len({text for _, _, text, _ in runs[0]}) > 180  # few repeats
    assert len(YAML_TEXTS) >= 30 and len(DSL_TEXTS) > len(YAML_TEXTS)


def test_own_errors_are_geomopt_errors():
    """The exceptions the contract allows are geomopt's own classes, each named in the package."""
    allowed = {cls for classes in OWN_ERRORS.values() for cls in classes}
    assert allowed == {geomopt.SpecError, NonFiniteGradientError}
    assert OWN_ERRORS["step"] == ()  # a step with finite gradients raises nothing


def test_fuzz_slice_keeps_the_contract(models):
    records = [run_mutant(SEED, i, models) for i in range(N)]
    findings = [r for r in records if r["outcome"] in FINDINGS]
    assert not findings, "\n".join(f"python scripts/fuzz.py --replay {SEED}:{r['i']}  {r}" for r in findings[:10])
    outcomes = collections.Counter(r["outcome"] for r in records)
    # the mutants reach every stage: a good share are valid specs that step
    assert outcomes["parse_refused"] > N // 5, outcomes
    assert outcomes["stepped"] > N // 4, outcomes
    assert outcomes["compile_refused"] + outcomes["build_refused"] > 0, outcomes
    assert {r["model"] for r in records if r["outcome"] == "stepped"} == set(models.models)
    assert any(r.get("nan_raised") for r in records) or N < 2000
    slow = sorted((r for r in records if r["seconds"] > HANG_S / 12), key=lambda r: -r["seconds"])
    if slow:  # reported, not asserted: timing is the machine's
        print("slow mutants:", [(r["i"], r["seconds"]) for r in slow[:10]])


def test_model_state_compares_bit_for_bit(models):
    """The refused-operation check sees one flipped bit, a -0.0 for a 0.0, a buffer and a mode."""
    model = models.fresh("cnn")
    before = model_state(model)
    assert same_state(before, model_state(model))
    with torch.no_grad():
        p = next(model.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(math.inf))
    assert not same_state(before, model_state(model))
    model = models.fresh("cnn")
    zero = [t for t in model.state_dict().values() if t.is_floating_point()][-1]
    zero.view(-1)[0] = 0.0
    before = model_state(model)
    zero.view(-1)[0] = -0.0
    assert not same_state(before, model_state(model))
    model = models.fresh("cnn")
    before = model_state(model)
    model.train(not model.training)
    assert not same_state(before, model_state(model))
    model.train(not model.training)


def test_checkpoint_generator_is_deterministic_and_varied():
    runs = [[checkpoint_mutant(Seeded(SEED, i)) for i in range(60)] for _ in range(2)]
    assert [(s, named) for s, _, named in runs[0]] == [(s, named) for s, _, named in runs[1]]
    assert {s for s, _, _ in runs[0]} == set(SPECS)
    assert len({tuple(named) for _, _, named in runs[0]}) > 40  # few repeats
    assert checkpoint_mutant(Seeded(SEED, 0))[2] != checkpoint_mutant(Seeded(SEED + 1, 0))[2]


def test_checkpoint_slice_keeps_the_contract():
    records = [run_checkpoint(SEED, i) for i in range(N_CHECKPOINTS)]
    findings = [r for r in records if r["outcome"] in CHECKPOINT_FINDINGS]
    assert not findings, "\n".join(f"python scripts/fuzz.py --replay-checkpoint {SEED}:{r['i']}  {r}"
                                    for r in findings[:10])
    outcomes = collections.Counter(r["outcome"] for r in records)
    # both ends are reached: mutants refused, and mutants (mostly nudged values) that load and step
    assert outcomes["refused"] > N_CHECKPOINTS // 2 and outcomes["stepped"] > N_CHECKPOINTS // 20, outcomes
    assert {r["spec"] for r in records} == set(SPECS)


def test_a_refusal_that_changed_the_model_is_a_finding(models):
    from fuzz_pipeline import _stage

    model = models.fresh("mlp")

    def writes_then_refuses():
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1
        return geomopt.parse_spec("geomopt: 1\nrules: 3\n", "yaml")

    out: dict = {}
    assert _stage(out, "compile", writes_then_refuses, "", model) == (False, None)
    assert out["outcome"] == "refused_wrote" and "refused_wrote" in FINDINGS
    out = {}
    assert _stage(out, "compile", lambda: geomopt.parse_spec("geomopt: 1\nrules: 3\n", "yaml"), "", model)[0] is False
    assert out["outcome"] == "compile_refused"
    models.fresh("mlp")
