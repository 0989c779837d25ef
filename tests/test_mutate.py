"""scripts/mutate.py's machinery on a tiny module: the mutants it makes, and what running them in
fork()ed children with their code swapped on the live functions gives (killed, survived, timed
out), a reference taken with ``from x import f`` before the swap included."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
MODULE = "mutate_tiny_units"
TEST_MODULE = "test_mutate_tiny_units"

SOURCE = textwrap.dedent('''
    """Tiny units with known mutants."""


    def relu(x):
        """max(x, 0)."""
        return x if x > 0 else 0.0


    def affine(x, k):
        return k * x + 1


    def steps(n):
        i = 0
        while i < n:
            i += 1
        return i


    class Base:
        def size(self):
            return 2


    class Box(Base):
        def size(self):
            return super().size() * 3

        def fail(self):
            raise ValueError(f"no box of size {-1 + 2}")
''')

TESTS = textwrap.dedent('''
    from mutate_tiny_units import Box, affine, relu, steps


    def test_relu():
        assert relu(2.0) == 2.0 and relu(0.5) == 0.5 and relu(-1.0) == 0.0 and relu(0.0) == 0.0


    def test_affine():
        assert affine(3.0, 2.0) == 7.0


    def test_steps():
        assert steps(3) == 3 and steps(0) == 0


    def test_box():
        assert Box().size() == 6
''')


@pytest.fixture(scope="module")
def mutate():
    return load_script(ROOT / "scripts" / "mutate.py", "mutate")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE, encoding="utf-8")
    (tmp_path / f"{TEST_MODULE}.py").write_text(TESTS, encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(TEST_MODULE)  # bound to the original functions before any swap
    yield tmp_path
    for name in (MODULE, TEST_MODULE):
        sys.modules.pop(name, None)


def _texts(ms):
    return {(m.qualname, m.op, m.original, m.mutated) for m in ms}


def test_mutants_are_the_expected_ones(mutate, tiny):
    ms = mutate.mutants(tiny / f"{MODULE}.py", MODULE, f"{MODULE}.py")
    assert _texts(ms) == {
        ("relu", "compare", "x > 0", "x >= 0"),
        ("relu", "constant", "0", "1"),
        ("relu", "constant", "0.0", "1.0"),
        ("affine", "binop", "k * x + 1", "k * x - 1"),
        ("affine", "unary_minus", "k * x + 1", "-(k * x + 1)"),
        ("affine", "binop", "k * x", "k / x"),
        ("affine", "constant", "1", "2"),
        ("affine", "constant", "1", "0"),
        ("steps", "constant", "0", "1"),
        ("steps", "compare", "i < n", "i <= n"),
        ("steps", "binop", "i += 1", "i -= 1"),
        ("steps", "constant", "1", "2"),
        ("steps", "constant", "1", "0"),
        ("Base.size", "constant", "2", "3"),
        ("Base.size", "constant", "2", "4"),
        ("Base.size", "constant", "2", "0"),
        ("Box.size", "binop", "super().size() * 3", "super().size() / 3"),
        ("Box.size", "unary_minus", "super().size() * 3", "-(super().size() * 3)"),
        ("Box.size", "constant", "3", "4"),
        ("Box.size", "constant", "3", "6"),
        ("Box.size", "constant", "3", "0"),
    }  # the docstring, and the raise's message with its arithmetic, have none
    assert all(m.path == f"{MODULE}.py" and m.key.startswith(f"{MODULE}.py:{m.line}:{m.col}: ") for m in ms)


def test_a_string_that_names_a_key_or_an_argument_leaves_the_arithmetic_mutable(mutate, tmp_path):
    """``1 - cfg["beta2"]`` and ``x / f(cfg["eps"], mode="a")`` are arithmetic (their strings name a key
    and an argument), mutated as any other; a string operand (concatenation, ``%`` formatting) or an
    f-string makes an expression a message, not mutated."""
    path = tmp_path / "keyed.py"
    path.write_text(textwrap.dedent('''
        def lerp(cfg, x, f):
            w = 1 - cfg["beta2"]
            return x / f(cfg["eps"], mode="a")


        def message(n):
            a = "n = " + str(n)
            b = "%d" % n
            return f"{n + 1}", a, b
    '''), encoding="utf-8")
    texts = _texts(mutate.mutants(path, "keyed", "keyed.py"))
    assert ("lerp", "binop", '1 - cfg["beta2"]', "1 + cfg['beta2']") in texts
    assert ("lerp", "unary_minus", '1 - cfg["beta2"]', "-(1 - cfg['beta2'])") in texts
    assert ("lerp", "binop", 'x / f(cfg["eps"], mode="a")', "x * f(cfg['eps'], mode='a')") in texts
    assert not {t for t in texts if t[0] == "message"}


def test_a_run_profiles_only_its_modules_test_files(mutate):
    """The map of tests to functions covers the test files of the modules a run mutates: a run of
    stages.py does not profile the geometry's tests, and a module's own test file is among its
    files."""
    stages = set(mutate._existing(["geomopt/optim/units/stages.py"]))
    polynomial = set(mutate._existing(["geomopt/geometry/polynomial.py"]))
    assert "tests/test_stage_rows.py" in stages and "tests/test_forward.py" not in stages
    assert {"tests/test_polynomial.py", "tests/test_forward.py"} <= polynomial
    assert stages | polynomial < set(mutate._existing())


def test_an_explanations_key_survives_edits_elsewhere_in_the_file(mutate, tiny):
    """Explanations are keyed by function and text (``stable_key``), unique in a file, so lines
    added above a mutant move its position and leave its key."""
    path = tiny / f"{MODULE}.py"
    before = mutate.mutants(path, MODULE, f"{MODULE}.py")
    assert len({m.stable_key for m in before}) == len(before)
    assert "steps: 1 -> 2 #2" not in {m.stable_key.split("::")[1] for m in before}  # one `1` in steps: no index
    path.write_text("# a comment\n\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
    after = mutate.mutants(path, MODULE, f"{MODULE}.py")
    assert [m.stable_key for m in after] == [m.stable_key for m in before]
    assert all(a.line == b.line + 2 and a.key != b.key for a, b in zip(after, before))


def test_the_tests_kill_the_killable_and_an_equivalent_mutant_survives(mutate, tiny):
    ms = mutate.mutants(tiny / f"{MODULE}.py", MODULE, f"{MODULE}.py")
    tests = [str(tiny / f"{TEST_MODULE}.py")]
    args = ("-c", str(tiny / "pytest.ini"), "--rootdir", str(tiny))
    looping = {("steps", "i += 1", "i -= 1"), ("steps", "1", "0")}  # i never reaches n: counting down, steps of 0
    # a generous timeout where the tests end (the machine may be busy), a short one where they cannot
    items = [(m, tiny / f"{MODULE}.py", tests, 2.0 if (m.qualname, m.original, m.mutated) in looping else 30.0)
             for m in ms]
    outcomes = mutate.run_mutants(items, workers=2, pytest_args=args)
    status = {(o.mutant.qualname, o.mutant.original, o.mutant.mutated): o.status for o in outcomes}
    assert "error" not in status.values() and "not_applied" not in status.values(), status
    # relu(0) is 0 whichever branch returns it: the one equivalent mutant
    assert [k for k, s in status.items() if s == "survived"] == [("relu", "x > 0", "x >= 0")], status
    assert {k for k, s in status.items() if s == "timed_out"} == looping
    assert all(s == "killed" for k, s in status.items() if k not in looping | {("relu", "x > 0", "x >= 0")})
    assert status[("Box.size", "3", "4")] == "killed"  # a method calling super(): its __class__ cell kept
    # the parent's functions are untouched
    tiny_module = sys.modules[MODULE]
    assert tiny_module.relu(0.5) == 0.5 and tiny_module.steps(3) == 3 and tiny_module.Box().size() == 6


def test_a_mutant_changes_the_function_every_reference_calls(mutate, tiny):
    """In this process (as a child does): the mutated code swapped onto the live function is what
    a reference imported earlier calls."""
    ms = mutate.mutants(tiny / f"{MODULE}.py", MODULE, f"{MODULE}.py")
    m = next(m for m in ms if m.qualname == "affine" and m.mutated == "k / x")
    ref = sys.modules[TEST_MODULE].affine
    before = ref.__code__
    try:
        mutate.apply(m, tiny / f"{MODULE}.py")
        assert ref(3.0, 2.0) == pytest.approx(2.0 / 3.0 + 1)
    finally:
        ref.__code__ = before
    assert ref(3.0, 2.0) == 7.0


def test_every_explanation_names_a_mutant_of_the_sources(mutate):
    keys = {m.stable_key for p in mutate.source_files(mutate.DEFAULT_MODULES)
            for m in mutate.mutants(ROOT / p, mutate.module_name(p), p)}
    stale = sorted(set(mutate.EXPLAINED) - keys)
    assert not stale, f"explanations of mutants that no longer exist (the code changed): {stale}"


def test_a_stopped_run_and_a_rerun_count_what_ran(mutate, tiny):
    """Past ``stop_at`` no mutant starts (the outcomes: those run, a prefix); a rerun's recount moves
    the survivors the tests now kill to killed and scores the rest with the explanations given."""
    ms = mutate.mutants(tiny / f"{MODULE}.py", MODULE, f"{MODULE}.py")
    args = ("-c", str(tiny / "pytest.ini"), "--rootdir", str(tiny))
    items = [(m, tiny / f"{MODULE}.py", [str(tiny / f"{TEST_MODULE}.py")], 30.0) for m in ms[:3]]
    assert mutate.run_mutants(items, pytest_args=args, stop_at=0.0) == []
    c = {"mutants": 10, "killed": 6, "timed_out": 1, "survived": 3, "explained": 1}
    after = mutate._recount(c, killed=2, explained=1)
    assert (after["killed"], after["survived"], after["explained"]) == (8, 1, 1)
    assert after["score"] == 0.9 and after["score_unexplained"] == 1.0


def test_a_per_module_outcome_is_kept_per_module_and_recounted(mutate, tmp_path):
    """``--per-module``: each module's record replaces that module's last and leaves the others; a rerun's
    recount of one record moves its survivors the tests now kill to killed, in the module's and the group's
    counts; the option refuses a sampled or stopped run."""
    out = tmp_path / "modules.json"
    a, b = "geomopt/geometry/a.py", "geomopt/geometry/b.py"

    def record(path: str, survivors: list[str]) -> dict:
        c = {"mutants": 4, "killed": 4 - len(survivors), "timed_out": 0, "survived": len(survivors),
             "explained": 0}
        return {"modules": {path: dict(c)}, "groups": {"geometry": dict(c)},
                "survivors": [{"key": f"{path}::f: {s}", "at": f"{path}:1:0"} for s in survivors]}

    mutate.record_per_module(a, record(a, ["1 -> 2"]), out)
    mutate.record_per_module(b, record(b, []), out)
    mutate.record_per_module(a, record(a, ["1 -> 2", "1 -> 0"]), out)
    data = json.loads(out.read_text(encoding="utf-8"))
    assert list(data["modules"]) == [a, b] and len(data["modules"][a]["survivors"]) == 2
    rec = data["modules"][a]
    mutate._recount_record(rec, {f"{a}::f: 1 -> 0"})
    assert [s["key"] for s in rec["survivors"]] == [f"{a}::f: 1 -> 2"]
    for c in (rec["modules"][a], rec["groups"]["geometry"]):
        assert (c["killed"], c["survived"], c["score"], c["score_unexplained"]) == (3, 1, 0.75, 0.75)
    with pytest.raises(SystemExit):
        mutate.main(["--per-module", str(out), "--max-mutants", "3"])
