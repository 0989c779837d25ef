"""Fuzzing routing lock files: whatever a lock file holds, reading it (``read_lock``), comparing a
built optimizer's plan with it (``check_routing``), ``GeomOptimizer(…, expect=FILE)`` and
``geomopt plan … --check FILE`` give a lock and its diff, or the documented errors — ``LockError``
(the file is no lock this geomopt reads; exit 2, one line naming the file) and
``RoutingChangedError`` (exit 1) — never another exception and never a hang; and a refused
operation leaves the model's parameters and the built optimizer's state as they were.

Inputs: the locks geomopt writes (MLP, GPT), mutated as text (characters and lines deleted,
duplicated, swapped, replaced) and as JSON (a value replaced by random JSON, a wrong type, a
number of thousands of digits or a value nested thousands deep; a key dropped or added); random
JSON; random text and bytes.

CI runs :data:`N` examples per test (``GEOMOPT_LOCK_FUZZ``, default 25: a few seconds in all);
``GEOMOPT_LOCK_FUZZ=5000 python -m pytest tests/test_lock_fuzz.py -q -s`` runs many more and
prints what each test saw.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.compile.lock_bounds import MAX_LOCK_DEPTH
from geomopt.compile.lock import (LockError, RoutingChangedError, check_routing, diff, dumps,
                                  lock_of, model_label, read_lock)
from geomopt.models import get_model
from geomopt.optim.persist.checkpoint import spec_hash
from geomopt.spec.validate import load_spec
from fuzz_pipeline import time_limit
from spec_mutants import PUT_CHARS, TEXT_OPS, apply_text_op
# the spec the optimizer is built with: building it projects the hidden matrices onto a spectral
# ball, so a build that went through with a refused lock would show in the parameters
from test_lock import CONSTRAINED

N = int(os.environ.get("GEOMOPT_LOCK_FUZZ", "25"))
FUZZ = settings(max_examples=N, deadline=None, database=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
HANG_S = 20  # one example past this is a hang (ordinary ones take milliseconds)
WORK = Path(tempfile.mkdtemp(prefix="geomopt-lock-fuzz-"))
SPEC_FILE = WORK / "constrained.yaml"
SPEC_FILE.write_text(CONSTRAINED, encoding="utf-8")
SPEC = load_spec(SPEC_FILE)
MODEL = get_model("mlp")
LOCK = lock_of(compile_spec(SPEC, MODEL), spec_hash(SPEC), model_label(MODEL))  # what the optimizer's plan routes
GPT = get_model("gpt")
BASES = [dumps(LOCK), dumps(lock_of(compile_spec("muon", GPT), spec_hash(load_spec("muon")), model_label(GPT)))]
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # test → outcomes



def _built():
    """An optimizer on the MLP that has stepped once (so it holds state), and its model."""
    model = get_model("mlp")
    opt = geomopt.GeomOptimizer(model, SPEC)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


BUILT_MODEL, BUILT = _built()


def snapshot(model, opt=None) -> list[torch.Tensor]:
    """Every tensor the model and the optimizer hold, copied (state in the state_dict's order)."""
    out = [p.detach().clone() for p in model.parameters()]
    if opt is not None:
        for state in opt.state_dict()["state"].values():
            out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def check(data: bytes, test: str) -> None:
    """The contract, on one lock file holding ``data``."""
    path = WORK / f"{test}.lock.json"
    path.write_bytes(data)
    with time_limit(HANG_S, f"{test}: {data[:80]!r}…"):
        try:
            lock = read_lock(path)
        except LockError as exc:
            error = str(exc)
            assert error.startswith(str(path)) and "\n" not in error and error.strip(), error
            lock = None
        if lock is not None:  # a lock: it compares and prints, whatever it holds
            d = diff(lock, LOCK)
            d.format()
            d.summary()
        # a built optimizer compared with the file: its parameters and state stay as they were
        before = snapshot(BUILT_MODEL, BUILT)
        try:
            check_routing(BUILT.plan, path, spec_hash=BUILT.spec_hash, model=model_label(BUILT_MODEL))
            outcome = "same routing"
        except LockError as exc:
            assert lock is None and str(exc) == error
            outcome = "refused: LockError"
        except RoutingChangedError as exc:
            assert lock is not None and exc.diff and str(exc).startswith("spec 'constrained' routes tensors")
            outcome = "refused: routing changed"
        assert unchanged(before, snapshot(BUILT_MODEL, BUILT)), outcome
        SEEN[test][outcome] += 1
        if lock is None and zlib.crc32(data) % 8:
            return  # read_lock refused it: GeomOptimizer and the command read it the same way (1 in 8 checked)
        # GeomOptimizer(expect=) on a fresh model: refused, nothing built and nothing projected
        model = get_model("mlp")
        before = snapshot(model)
        try:
            geomopt.GeomOptimizer(model, SPEC, expect=path)
            assert outcome == "same routing"
        except (LockError, RoutingChangedError) as exc:
            assert outcome.startswith("refused") and unchanged(before, snapshot(model))
            assert isinstance(exc, LockError) == (outcome == "refused: LockError")
        # the command: exit 0, 1 with the diff, or 2 with one line naming the file
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", str(SPEC_FILE), "--model", "mlp", "--check", str(path)])
        expected = {"same routing": 0, "refused: routing changed": 1, "refused: LockError": 2}[outcome]
        assert code == expected, (code, out.getvalue(), err.getvalue())
        assert "Traceback" not in out.getvalue() + err.getvalue()
        (out.getvalue() + err.getvalue()).encode("utf-8")  # printable: no lone surrogate from the file
        if code == 2:
            assert err.getvalue() == f"geomopt plan: error: {error}\n" and out.getvalue() == ""


def check_text(text: str, test: str) -> None:
    check(text.encode("utf-8", "surrogatepass"), test)


@pytest.fixture(scope="module", autouse=True)
def outcomes():
    """What the tests saw, printed with -s (a large GEOMOPT_LOCK_FUZZ run's report)."""
    yield
    for test, seen in sorted(SEEN.items()):
        print(f"\n{test}: {sum(seen.values())} examples, {dict(seen)}")


# ---------------------------------------------------------------- strategies

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=5), max_leaves=20)


@st.composite
def raw_json(draw) -> str:
    """A JSON value's text that json.dumps would not write: nested thousands deep, a number of
    thousands of digits, a constant json accepts (NaN), or text that is no JSON at all."""
    kind = draw(st.sampled_from(["deep", "number", "constant", "junk", "json"]))
    if kind == "deep":
        n = draw(st.one_of(st.integers(MAX_LOCK_DEPTH - 4, MAX_LOCK_DEPTH + 4), st.integers(1, 200_000)))
        opener = draw(st.sampled_from(["[", '{"a": ', '[{"name": ']))
        closer = {"[": "]", '{"a": ': "}", '[{"name": ': "}]"}[opener]
        inner = draw(st.sampled_from(["1", '""', "[]", "{}", ""]))
        deep = opener * n + inner + closer * draw(st.sampled_from([n, 0, n // 2]))
        if draw(st.booleans()):  # behind a string of closing brackets, which a count of brackets would see
            return '["' + draw(st.sampled_from(["]", "}", "["])) * draw(st.integers(0, 200_000)) + '", ' + deep + "]"
        return deep
    if kind == "number":
        digits = draw(st.one_of(st.integers(1, 30), st.integers(4_290, 4_310), st.integers(1, 20_000)))
        sign = draw(st.sampled_from(["", "-"]))
        tail = draw(st.sampled_from(["", ".5", "e99999", "e-99999", "E+7"]))
        return sign + draw(st.sampled_from("123456789")) + "0" * (digits - 1) + tail
    if kind == "constant":
        return draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "true", "null", '"\\ud800"', '"\\u0000"']))
    if kind == "junk":
        return draw(st.text(alphabet=st.sampled_from(list(PUT_CHARS) + ["\\", "0", "a", "\ud800"]), max_size=20))
    return json.dumps(draw(JSON))


def _paths(value, at=()):
    """Every path (keys and indices) into a parsed JSON value, the root first."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))


SENTINEL = "\x00raw\x00"


@st.composite
def json_mutated(draw) -> str:
    """A lock geomopt wrote, with one to three edits at random places of its JSON: a value
    replaced (random JSON, a wrong type, or raw text), a key dropped, a key added."""
    data = json.loads(draw(st.sampled_from(BASES)))
    raws = []
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(data))
        at = draw(st.sampled_from(paths))
        parent = data
        for k in at[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "raw", "drop", "add"] if at else ["replace", "raw"]))
        if op == "add":
            target = parent[at[-1]]
            if isinstance(target, dict):
                target[draw(st.sampled_from(["name", "shape", "role", "extra", "tensors", "frozen"]))] = draw(JSON)
            elif isinstance(target, list):
                target.insert(draw(st.integers(0, len(target))), draw(JSON))
            continue
        if op == "drop":
            del parent[at[-1]]
            continue
        value = draw(JSON) if op == "replace" else SENTINEL + str(len(raws))
        if op == "raw":
            raws.append(draw(raw_json()))
        if not at:
            data = value
        else:
            parent[at[-1]] = value
    text = json.dumps(data, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(SENTINEL + str(i)), raw, 1)
    return text


@st.composite
def text_mutated(draw) -> str:
    text = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(TEXT_OPS))
        text = apply_text_op(text, op, lambda n: draw(st.integers(0, n - 1)),
                             lambda: draw(st.one_of(st.sampled_from(list(PUT_CHARS)), st.characters())))
    return text


@st.composite
def routing_edited(draw) -> str:
    """The optimizer's own lock with entries' routing fields changed to other valid values, some
    entries dropped or renamed, the header changed: a valid lock that is a diff (or none)."""
    data = json.loads(BASES[0])
    for entry in data["tensors"]:
        field = draw(st.sampled_from(["none", "none", "rule", "role", "view", "shape", "name", "drop"]))
        if field in ("rule", "role", "view", "name"):
            entry[field] = draw(st.sampled_from(["hidden", "rest", "-", "4×4", "", "h.1.w", "🙂", "layers.10.weight"]))
        elif field == "shape":
            entry["shape"] = draw(st.lists(st.integers(0, 2 ** 63), max_size=4))
        elif field == "drop":
            entry["name"] = None
    data["tensors"] = [e for e in data["tensors"] if e["name"] is not None]
    if draw(st.booleans()):
        data["spec"] = {"name": draw(st.text(max_size=10)), "hash": draw(st.text(max_size=10))}
        data["model"] = draw(st.none() | st.text(max_size=10))
    data["frozen"] = draw(st.lists(st.sampled_from(["layers.0.weight", "head.bias", "x"]), max_size=3))
    return json.dumps(data, ensure_ascii=False)


# ---------------------------------------------------------------- tests


def test_the_locks_mutated_here_are_valid_and_match():
    """The bases are locks read back as written; the first is the built optimizer's routing."""
    for text in BASES:
        path = WORK / "base.lock.json"
        path.write_text(text, encoding="utf-8")
        assert dumps(read_lock(path)).splitlines()[5:] == text.splitlines()[5:]  # from "tensors" on
    check_text(BASES[0], "base")
    assert SEEN["base"] == {"same routing": 1}


@FUZZ
@given(json_mutated())
def test_json_mutated_locks(text):
    check_text(text, "json_mutated")


@FUZZ
@given(text_mutated())
def test_text_mutated_locks(text):
    check_text(text, "text_mutated")


@FUZZ
@given(routing_edited())
def test_locks_with_other_routing(text):
    check_text(text, "routing_edited")


@FUZZ
@given(st.one_of(JSON.map(json.dumps), raw_json()))
def test_random_json(text):
    check_text(text, "random_json")


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_random_bytes(data):
    check(data, "random_bytes")
