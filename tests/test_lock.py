"""The routing lock (geomopt.compile.lock): written and read back without a diff for the built-in
models and a Hugging Face Llama; a spec edit that moves tensors shows exactly those tensors, and
`plan --check` exits 1 with them; a lock from another model or spec is a diff, never a crash;
malformed lock files are a clear error naming the file (exit 2, no traceback); and
`GeomOptimizer(..., expect=)` refuses a changed routing before it touches the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.compile.lock import (Lock, LockError, Route, RoutingChangedError, diff, dumps, loads, lock_of, model_label,
                                  name_key, read_lock, write_lock)
from geomopt.models import get_model
from geomopt.optim.persist.checkpoint import spec_hash
from geomopt.spec.validate import load_spec

ROOT = Path(__file__).resolve().parents[1]
MUON = ROOT / "specs" / "muon.yaml"
MUON_TEXT = MUON.read_text(encoding="utf-8")
HIDDEN_MATCH = "match: {role: [hidden, expert]}"
assert HIDDEN_MATCH in MUON_TEXT  # the edit below relies on it
# Muon with the hidden rule's `hidden` role removed: hidden matrices fall to the AdamW catch-all
MUON_FALLBACK = MUON_TEXT.replace(HIDDEN_MATCH, "match: {role: [expert]}")


def run(capsys, *argv):
    """(exit status, stdout, stderr) of one in-process run; never a raised exception."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def lock_for(spec, model) -> Lock:
    spec = load_spec(spec) if isinstance(spec, (str, Path)) else spec
    return lock_of(compile_spec(spec, model), spec_hash(spec), model_label(model))


@pytest.fixture
def fallback_spec(tmp_path):
    return _write(tmp_path / "muon-fallback.yaml", MUON_FALLBACK)


@pytest.fixture
def gpt_lock(tmp_path):
    path = tmp_path / "routing.lock.json"
    write_lock(lock_for(MUON, get_model("gpt")), path)
    return path


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn", "llama"])
def test_round_trip_has_no_diff(tmp_path, name):
    model = tiny_llama() if name == "llama" else get_model(name)
    plan = compile_spec("muon", model)
    lock = lock_of(plan, spec_hash(load_spec("muon")), model_label(model))
    path = tmp_path / "routing.lock.json"
    write_lock(lock, path)
    back = read_lock(path)
    d = diff(back, lock_of(compile_spec("muon", model), spec_hash(load_spec("muon")), model_label(model)))
    assert not d and d.notes == []
    assert (back.routes, back.spec_name, back.spec_hash, back.model, back.version) == (
        lock.routes, "muon", spec_hash(load_spec("muon")), type(model).__name__, geomopt.__version__)
    assert back.file == str(path)
    # what the file says is the plan's routing, one tensor per line
    lines = [json.loads(line.rstrip(",")) for line in path.read_text(encoding="utf-8").splitlines()
             if line.lstrip().startswith('{"name"')]
    assert {e["name"]: (tuple(e["shape"]), e["role"], e["rule"]) for e in lines} == {
        p.name: (p.shape, p.role, p.rule) for p in plan}
    # a Muon spec sends the hidden matrices to its spectral rule, each read as its matrices
    hidden = [e for e in lines if e["rule"] == "hidden"]
    assert hidden and all(e["view"] != "-" for e in hidden)


def test_lock_file_is_sorted_by_name_with_numbers_as_numbers(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    lock = lock_for(MUON, model)
    text = dumps(lock)
    names = [json.loads(line.rstrip(","))["name"] for line in text.splitlines() if line.lstrip().startswith("{\"name")]
    assert names == sorted((n for n, _ in model.named_parameters()), key=lambda n: (int(n.split(".")[0]), n))
    assert names.index("2.weight") < names.index("10.weight")  # not string order
    assert name_key("layers.2.w") < name_key("layers.10.w")
    header = json.loads(text)
    assert header["geomopt-lock"] == 1 and header["spec"] == {"name": "muon", "hash": spec_hash(load_spec(MUON))}
    assert header["model"] == "Sequential" and header["geomopt"] == geomopt.__version__
    assert loads(text).routes == lock.routes


def test_a_change_that_routes_nothing_differently_passes_with_a_note(tmp_path):
    model = get_model("mlp")
    before = lock_for(MUON, model)
    other_lr = load_spec(str(_write(tmp_path / "lr.yaml", MUON_TEXT.replace("lr: 0.02", "lr: 0.03"))))
    d = diff(before, lock_for(other_lr, model))
    assert not d
    assert len(d.notes) == 1 and "spec 'muon'" in d.notes[0] and spec_hash(other_lr) in d.notes[0]


# ---------------------------------------------------------------- a routing change


def test_a_spec_edit_shows_exactly_the_moved_tensors(fallback_spec):
    model = get_model("gpt")
    plan = compile_spec("muon", model)
    moved = sorted((p.name for p in plan if p.rule == "hidden"), key=name_key)
    assert moved  # the edit has something to move
    d = diff(lock_for(MUON, model), lock_for(fallback_spec, model))
    assert d and d.added == [] and d.removed == [] and d.changed == moved
    for name in moved:
        before, after = d.before.routes[name], d.after.routes[name]
        assert (before.rule, after.rule) == ("hidden", "rest") and after.view == "-"
        assert before.role == after.role and before.shape == after.shape
    text = d.format()
    assert f"{len(moved)} changed, 0 added, 0 removed" in text
    assert all(f"  {n}" in text for n in moved)
    assert "rule hidden → rest" in text and text.count("the lock was written for spec") == 1


def test_cli_lock_then_check(capsys, tmp_path, gpt_lock, fallback_spec):
    path = tmp_path / "written.lock.json"
    code, out, err = run(capsys, "plan", "muon", "--model", "gpt", "--lock", path)
    assert code == 0 and out == ""
    assert f"wrote {path}" in err and "model GPT" in err
    assert read_lock(path).routes == read_lock(gpt_lock).routes
    code, out, err = run(capsys, "plan", "muon", "--model", "gpt", "--check", path)
    assert code == 0 and out == "" and "routing unchanged" in err
    # the edit: exit 1, the diff on stdout, one line per moved tensor
    moved = [p.name for p in compile_spec("muon", get_model("gpt")) if p.rule == "hidden"]
    code, out, err = run(capsys, "plan", fallback_spec, "--model", "gpt", "--check", path)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"routing changed against {path}: {len(moved)} changed, 0 added, 0 removed")
    changed = [line.split()[0] for line in lines if "rule hidden → rest" in line]
    assert sorted(changed) == sorted(moved)
    assert out.count("the lock was written for spec") == 1


def test_cli_lock_and_check_from_a_checkpoint(capsys, tmp_path, fallback_spec):
    ckpt = tmp_path / "gpt.pt"
    torch.save(get_model("gpt").state_dict(), ckpt)
    path = tmp_path / "ckpt.lock.json"
    code, _, err = run(capsys, "plan", "muon", "--checkpoint", ckpt, "--lock", path)
    assert code == 0 and "model gpt.pt" in err
    lock = read_lock(path)
    assert lock.model == "gpt.pt" and len(lock.routes) == len(compile_spec("muon", get_model("gpt")))
    assert run(capsys, "plan", "muon", "--checkpoint", ckpt, "--check", path)[0] == 0
    code, out, _ = run(capsys, "plan", fallback_spec, "--checkpoint", ckpt, "--check", path)
    assert code == 1 and "rule hidden → rest" in out


def test_a_lock_from_another_model_is_a_diff(capsys, tmp_path):
    path = tmp_path / "mlp.lock.json"
    assert run(capsys, "plan", "muon", "--model", "mlp", "--lock", path)[0] == 0
    code, out, err = run(capsys, "plan", "muon", "--model", "gpt", "--check", path)
    assert code == 1 and err == ""
    gpt = [n for n, _ in get_model("gpt").named_parameters()]
    mlp = [n for n, _ in get_model("mlp").named_parameters()]
    assert f"0 changed, {len(set(gpt) - set(mlp))} added, {len(set(mlp) - set(gpt))} removed" in out
    assert out.count("the lock was written for model MLP, this plan is for GPT") == 1
    assert "the lock was written for spec" not in out  # same spec: nothing to say about it
    # the long group is cut at 20 lines, with a count of the rest
    assert f"… and {len(gpt) - 20} more added" in out
    assert sum(line.startswith("  ") and line.split()[0] in gpt for line in out.splitlines()) == 20


def test_long_groups_are_truncated_with_a_count():
    routes = {f"layers.{i}.weight": Route((4, 4), "hidden", "hidden", "4×4") for i in range(30)}
    before = Lock("s", "h", None, geomopt.__version__, routes)
    after = Lock("s", "h", None, geomopt.__version__,
                 {n: Route(r.shape, r.role, "rest", "-") for n, r in routes.items()})
    text = diff(before, after).format(limit=7)
    assert text.count("rule hidden → rest") == 7 and "… and 23 more changed" in text
    shown = [line.split()[0] for line in text.splitlines() if "→" in line]
    assert shown == [f"layers.{i}.weight" for i in range(7)]


def test_a_tensor_frozen_since_the_lock_is_removed_and_said(tmp_path):
    model = get_model("mlp")
    before = lock_for(MUON, model)
    model.layers[0].weight.requires_grad_(False)
    d = diff(before, lock_for(MUON, model))
    assert d.removed == ["layers.0.weight"] and d.added == d.changed == []
    assert "(now frozen)" in d.format()
    back = diff(lock_for(MUON, model), before)  # and the other way round: it was frozen in the lock
    assert back.added == ["layers.0.weight"] and "(frozen in the lock)" in back.format()


# ---------------------------------------------------------------- malformed locks


def _valid_text() -> str:
    return dumps(lock_for(MUON, get_model("mlp")))


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _entry_broken(field: str, value) -> tuple[str, str]:
    """The valid lock with one field of layers.1.weight's entry replaced (None: removed)."""
    text = _valid_text()
    lines = text.splitlines()
    k = _line_of(text, '"name": "layers.1.weight"') - 1
    entry = json.loads(lines[k].rstrip(","))
    if value is None:
        del entry[field]
    else:
        entry[field] = value
    lines[k] = "    " + json.dumps(entry, ensure_ascii=False) + ("," if lines[k].endswith(",") else "")
    return "\n".join(lines) + "\n", f":{k + 1}: tensor 'layers.1.weight'"


def _cases() -> dict:
    text = _valid_text()
    data = json.loads(text)
    model_line = _line_of(text, '"model"')  # where a merge conflict's marker lands below
    cases: dict = {
        "bad json": (text.replace('"model":', '"model"'), ": not valid JSON"),
        "merge conflict": (text.replace('  "model"', '<<<<<<< HEAD\n  "model"', 1),
                           f":{model_line}: an unresolved merge conflict"),
        "empty": ("", "empty file"),
        "foreign json": ('{"name": "left-pad", "version": "1.3.0"}\n', "not a geomopt routing lock"),
        "a list": ("[]\n", "not a geomopt routing lock"),
        "newer format": (text.replace('"geomopt-lock": 1', '"geomopt-lock": 2'), "upgrade geomopt"),
        "format as text": (text.replace('"geomopt-lock": 1', '"geomopt-lock": "1"'),
                           f":{_line_of(text, 'geomopt-lock')}: lock format '1'"),
        "missing tensors": (json.dumps({k: v for k, v in data.items() if k != "tensors"}), "missing key(s) 'tensors'"),
        "unknown key": (text.replace('"frozen"', '"frozne"'), "unknown key(s) 'frozne'"),
        "bad spec": (text.replace('"spec": {"name"', '"spec": {"nom"'), '"spec" must be'),
        "shape as text": _entry_broken("shape", "128x128"),
        "missing rule": _entry_broken("rule", None),
        "role not text": _entry_broken("role", 3),
        "listed twice": (text.replace('"name": "layers.1.weight"', '"name": "layers.0.weight"'),
                         f":{_line_of(text, 'layers.1.weight')}: tensor 'layers.0.weight' is listed twice"),
    }
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_locks_are_a_clear_error(capsys, tmp_path, case):
    text, needle = CASES[case]
    path = _write(tmp_path / "routing.lock.json", text)
    with pytest.raises(LockError) as info:
        read_lock(path)
    message = str(info.value)
    assert message.startswith(str(path)) and needle in message
    code, out, err = run(capsys, "plan", "muon", "--model", "mlp", "--check", path)
    assert code == 2 and out == ""
    assert err.startswith("geomopt plan: error: ") and str(path) in err and needle in err


def test_bad_json_points_at_its_line(tmp_path):
    text = _valid_text()
    broken = text.replace('"model": "MLP",', '"model": "MLP"')  # a comma lost in a hand edit
    path = _write(tmp_path / "routing.lock.json", broken)
    line = _line_of(text, '"geomopt":')  # where the parser finds the missing comma
    with pytest.raises(LockError, match=rf"^{path}:{line}:\d+: not valid JSON"):
        read_lock(path)


@pytest.mark.parametrize("kind", ["directory", "missing", "binary"])
def test_unreadable_lock_paths_exit_2(capsys, tmp_path, kind):
    path = tmp_path / "routing.lock.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    needle = {"directory": "a directory, not a regular file", "missing": "no such lock file",
              "binary": "not UTF-8"}[kind]
    with pytest.raises(LockError, match=needle):
        read_lock(path)
    code, out, err = run(capsys, "plan", "muon", "--model", "mlp", "--check", path)
    assert code == 2 and out == "" and str(path) in err and needle in err


def test_lock_usage_errors_exit_2(capsys, tmp_path, gpt_lock):
    code, _, err = run(capsys, "plan", "muon", "--model", "mlp", "--lock", tmp_path / "no" / "such" / "dir.json")
    assert code == 2 and "cannot write lock" in err
    code, _, err = run(capsys, "plan", "muon", "--model", "mlp", "--check", gpt_lock, "--format", "json")
    assert code == 2 and "--format applies to the plan's table" in err
    assert run(capsys, "plan", "muon", "--model", "mlp", "--check", gpt_lock, "--lock", gpt_lock)[0] == 2
    code, _, err = run(capsys, "plan", "muon", "--check", gpt_lock)
    assert code == 2 and "plan needs --model" in err


# ---------------------------------------------------------------- GeomOptimizer(expect=)


def test_expect_passes_when_the_routing_is_the_lock(gpt_lock):
    model = get_model("gpt")
    opt = geomopt.GeomOptimizer(model, "muon", expect=gpt_lock)
    assert {p.name: p.rule for p in opt.plan} == {n: r.rule for n, r in read_lock(gpt_lock).routes.items()}
    assert geomopt.GeomOptimizer(model, "muon", expect=read_lock(gpt_lock)).plan.params == opt.plan.params
    assert geomopt.GeomOptimizer(model, "muon", expect=str(gpt_lock)).plan.params == opt.plan.params


CONSTRAINED = """geomopt: 1
name: constrained
rules:
  - name: hidden
    match: {role: [hidden]}
    geometry: {kind: spectral, reference: {kind: indicator}}
    constraint: {kind: spectral_ball, radius: 0.01}
  - name: rest
    match: "**"
    geometry: {kind: adam}
"""


def test_expect_refuses_a_changed_routing_before_touching_the_model(tmp_path):
    model = get_model("gpt")
    lock = lock_for(load_spec(str(_write(tmp_path / "c.yaml", CONSTRAINED))), model)
    # the edit moves the embeddings into the constrained rule, which projects them when built
    moved_spec = CONSTRAINED.replace("role: [hidden]", "role: [hidden, embedding]")
    embeddings = sorted((n for n, r in lock.routes.items() if r.role == "embedding"), key=name_key)
    assert embeddings
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(geomopt.RoutingChangedError) as info:
        geomopt.GeomOptimizer(model, moved_spec, expect=lock)
    assert isinstance(info.value, ValueError)
    assert info.value.diff.changed == embeddings and not info.value.diff.added and not info.value.diff.removed
    message = str(info.value)
    assert all(n in message for n in embeddings) and "rule rest → hidden" in message and "--lock" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # without expect the same spec changes the weights: the check above could have failed
    geomopt.GeomOptimizer(model, moved_spec)
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_expect_with_an_unreadable_lock_says_which_file(tmp_path):
    model = get_model("mlp")
    missing = tmp_path / "nope.lock.json"
    with pytest.raises(LockError, match=f"^{missing}: no such lock file"):
        geomopt.GeomOptimizer(model, "muon", expect=missing)
    with pytest.raises(TypeError, match="expect must be a lock file's path"):
        geomopt.GeomOptimizer(model, "muon", expect=3)


def test_routing_changed_error_is_exported():
    assert geomopt.RoutingChangedError is RoutingChangedError and "RoutingChangedError" in geomopt.__all__
    assert issubclass(RoutingChangedError, ValueError) and issubclass(LockError, ValueError)


# ---------------------------------------------------------------- hostile locks


def test_names_with_long_digit_runs_sort_as_numbers():
    """int() of a digit run over 4,300 digits raised ValueError while sorting a diff."""
    big, bigger = "9" * 5000, "1" + "0" * 5000
    names = [f"h.{bigger}.w", f"h.{big}.w", "h.10.w", "h.2.w", "h.02.w", "h.b", "h.a"]
    assert sorted(names, key=name_key) == ["h.2.w", "h.02.w", "h.10.w", f"h.{big}.w", f"h.{bigger}.w", "h.a", "h.b"]
    route = Route((4, 4), "hidden", "hidden", "4×4")
    lock = Lock("muon", "x", "MLP", geomopt.__version__, {n: route for n in names})
    d = diff(loads(dumps(lock)), Lock("muon", "x", "MLP", geomopt.__version__, {}))
    assert d.removed == sorted(names, key=name_key) and f"h.{big}.w" in d.format()


def _big_locks(n: int) -> tuple[str, Lock]:
    """A lock of ``n`` tensors, and a plan's lock that differs in every way a diff counts: a third
    of the tensors changed, a third removed, as many added; the lock's frozen list as long."""
    route, other = Route((64, 64), "hidden", "hidden", "64×64"), Route((64, 64), "hidden", "rest", "-")
    names = [f"model.layers.{i // 100}.mlp.experts.{i % 100}.w{i % 3}" for i in range(n)]
    before = Lock("muon", "a", "M", "0", {m: route for m in names}, tuple(f"frozen.{i}" for i in range(n)))
    after = {m: other for m in names[: n // 3]} | {m: route for m in names[n // 3: 2 * n // 3]}
    after |= {f"new.{i}": route for i in range(n // 3)}
    return dumps(before), Lock("muon", "b", "M", "1", after, ("frozen.0",))


def test_comparison_is_linear_in_the_lock(tmp_path):
    """Reading, comparing and printing the diff of a lock make a number of Python calls proportional
    to its size (counted by cProfile, so the figure does not move with the machine's load)."""
    import cProfile
    import pstats

    def calls(n: int) -> int:
        text, plan = _big_locks(n)
        path = _write(tmp_path / f"l{n}.json", text)
        profile = cProfile.Profile()
        profile.enable()
        d = diff(read_lock(path), plan)
        d.format()
        profile.disable()
        assert len(d.changed) == len(d.removed) == len(d.added) == n // 3
        return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]

    small, large = calls(3_000), calls(24_000)
    assert large <= 8 * 1.1 * small, (small, large)  # 8x the tensors: linear is 8x, n log n ~10x, quadratic 64x


def test_the_cli_guide_states_the_lock_limits():
    from geomopt.compile.lock import MAX_LOCK_BYTES
    from geomopt.compile.lock_bounds import MAX_LOCK_DEPTH
    from geomopt.spec.source import MAX_INT_DIGITS

    text = " ".join((ROOT / "docs" / "guide" / "cli.md").read_text(encoding="utf-8").split())
    assert MAX_LOCK_BYTES % (1 << 20) == 0
    assert (f"at most {MAX_LOCK_BYTES >> 20} MiB" in text and f"nested at most {MAX_LOCK_DEPTH} levels" in text
            and f"at most {MAX_INT_DIGITS:,} digits" in text)


@pytest.mark.parametrize("escape, refused", [
    ("\\ud800", True), ("\\uDFFF", True), ("\\ud83d x", True), ("\\\\\\ud800", True),
    ("\\ud83d\\ude00", False), ("\\\\ud800", False),  # a pair (🙂); a backslash, then the text ud800
])
def test_a_lone_surrogate_escape_is_refused_where_written(capsys, tmp_path, escape, refused):
    """json.loads keeps "\\ud800" as a string that no output can encode: the diff's print raised
    UnicodeEncodeError (a traceback)."""
    text = _valid_text().replace('"name": "head.bias"', f'"name": "head.bias{escape}"')
    path = _write(tmp_path / "routing.lock.json", text)
    line = _line_of(text, "head.bias")
    if refused:
        with pytest.raises(LockError, match=rf"^{path}:{line}:\d+: a \\u escape that is half of a surrogate pair"):
            read_lock(path)
    else:
        assert any(n.startswith("head.bias") and n != "head.bias" for n in read_lock(path).routes)
    code, out, err = run(capsys, "plan", "muon", "--model", "mlp", "--check", path)
    assert code == (2 if refused else 1) and (out + err).encode("utf-8")
