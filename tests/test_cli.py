"""The `geomopt` command, in process (``main([...])`` with capsys) plus two subprocess runs for
the entry point: exit codes, output formats, checkpoints, plan, fmt, schema, --model factories,
and no traceback for any user mistake."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import geomopt
from geomopt.cli.main import main
from geomopt.compile import compile_spec
from geomopt.lint import RULES
from geomopt.models import MODELS
from geomopt.spec.diagnostics import LANGUAGE_CODES

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted(str(p) for p in (ROOT / "specs").glob("*.yaml"))
USCION = str(ROOT / "specs" / "uscion.yaml")
TEXT_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning|note) (?P<code>GO\d{3}) (?P<msg>.+)$")

# A spec with an error (GO101: biases unmatched) and a warning (GO102: a rule that matches nothing)
BAD = """geomopt: 1
name: bad
rules:
  - name: typo
    match: "nothing.*"
    geometry: {kind: euclidean}
  - name: weights
    match: "**.weight"
    geometry: {kind: euclidean}
"""
# Only a warning (GO102) against the mlp reference model
WARN = """geomopt: 1
name: warn
rules:
  - name: typo
    match: "nothing.*"
    geometry: {kind: euclidean}
  - name: rest
    match: "**"
    geometry: {kind: euclidean}
"""


def run(capsys, *argv):
    """(exit status, stdout, stderr) of one in-process run; never a raised exception."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    return str(path)


@pytest.fixture
def warn(tmp_path):
    path = tmp_path / "warn.yaml"
    path.write_text(WARN, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- exit codes


def test_clean_specs_exit_0(capsys):
    code, out, _ = run(capsys, "lint", *SPECS, "--model", "gpt")
    assert code == 0
    assert all(TEXT_LINE.match(line).group("sev") == "note" for line in out.splitlines())


def test_clean_specs_exit_0_even_under_strict(capsys):
    assert run(capsys, "lint", *SPECS, "--model", "gpt", "--strict")[0] == 0
    assert run(capsys, "lint", *SPECS, "--strict")[0] == 0


def test_errors_exit_1(capsys, bad):
    code, out, _ = run(capsys, "lint", bad, "--model", "mlp")
    assert code == 1
    codes = {TEXT_LINE.match(line).group("code") for line in out.splitlines()}
    assert codes == {"GO101", "GO102"}


def test_warnings_exit_1_only_under_strict(capsys, warn):
    code, out, _ = run(capsys, "lint", warn, "--model", "mlp")
    assert code == 0 and "GO102" in out
    assert run(capsys, "lint", warn, "--model", "mlp", "--strict")[0] == 1


def test_spec_errors_exit_1(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("geomopt: 1\nname: t\nrules:\n  - name: a\n    match: '**'\n    geometry: {kind: spectrall}\n")
    code, out, _ = run(capsys, "lint", str(path))
    assert code == 1
    m = TEXT_LINE.match(out.splitlines()[0])
    assert (m.group("file"), m.group("line"), m.group("code")) == (str(path), "6", "GO004")


@pytest.mark.parametrize("argv, needle", [
    (["lint", USCION, "--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
    (["lint", USCION, "--model", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
    (["lint", USCION, "--model", "geomopt.models:no_such_factory"], "has no attribute 'no_such_factory'"),
    (["lint", USCION, "--model", ":make"], "pkg.module:factory"),
    (["lint", USCION, "--checkpoint", "/nonexistent/model.safetensors"], "cannot read checkpoint"),
    (["plan", USCION], "plan needs --model"),
    (["rule", "GO999"], "unknown rule 'GO999'"),
])
def test_usage_errors_exit_2_with_a_message(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and err.startswith(f"geomopt {argv[0]}: error:")


def test_missing_spec_file_exits_2(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    code, out, _ = run(capsys, "lint", missing)
    assert code == 2
    assert TEXT_LINE.match(out.strip()).group("code") == "GO010" and missing in out


def test_binary_spec_file_exits_2(capsys, tmp_path):
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    code, out, _ = run(capsys, "lint", str(path))
    assert code == 2 and "GO010" in out


def test_unreadable_input_wins_over_findings(capsys, tmp_path, bad):
    code, out, _ = run(capsys, "lint", bad, str(tmp_path / "missing.yaml"), "--model", "mlp")
    assert code == 2 and "GO101" in out and "GO010" in out


def test_argparse_usage_errors_exit_2(capsys):
    assert run(capsys)[0] == 2
    assert run(capsys, "lint")[0] == 2
    assert run(capsys, "lint", USCION, "--format", "xml")[0] == 2
    assert run(capsys, "lint", USCION, "--model", "gpt", "--checkpoint", "x.pt")[0] == 2


# ---------------------------------------------------------------- output formats


def test_text_format(capsys, bad):
    _, out, _ = run(capsys, "lint", bad, "--model", "mlp")
    lines = out.splitlines()
    assert lines
    for line in lines:
        m = TEXT_LINE.match(line)
        assert m and m.group("file") == bad
        assert int(m.group("line")) >= 1 and int(m.group("col")) >= 1
        assert m.group("sev") == (RULES[m.group("code")].severity)
    assert f"{bad}:5:12: warning GO102 rule 'typo'" in out


def test_json_format(capsys, bad):
    code, out, _ = run(capsys, "lint", bad, "--model", "mlp", "--format", "json")
    assert code == 1
    data = json.loads(out)
    assert isinstance(data, list) and data
    for d in data:
        assert set(d) == {"code", "name", "severity", "message", "file", "line", "col"}
        assert d["file"] == bad and d["name"] == RULES[d["code"]].name
    assert {d["code"] for d in data} == {"GO101", "GO102"}
    assert json.loads(run(capsys, "lint", USCION, "--format", "json")[1]) == []


def test_github_format(capsys, bad):
    code, out, _ = run(capsys, "lint", bad, "--model", "mlp", "--format", "github")
    assert code == 1
    lines = out.splitlines()
    assert lines and all(line.startswith(("::error file=", "::warning file=", "::notice file=")) for line in lines)
    assert f"::warning file={bad},line=5,col=12,title=GO102 unused-rule::" in out
    assert any(line.startswith(f"::error file={bad},line=4,col=3,title=GO101 unmatched-parameter::") for line in lines)
    code, out, _ = run(capsys, "lint", SPECS[0], "--model", "gpt", "--format", "github")
    assert all(line.startswith("::notice ") for line in out.splitlines())


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.torch import save_file

    model = MODELS["gpt"]()
    folder = tmp_path_factory.mktemp("ckpt")
    pt, st = folder / "gpt.pt", folder / "gpt.safetensors"
    torch.save(model.state_dict(), pt)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(st))
    return {"pt": str(pt), "safetensors": str(st), "model": model}


@pytest.mark.parametrize("kind", ["pt", "safetensors"])
def test_lint_against_a_checkpoint(capsys, checkpoints, kind, bad):
    path = checkpoints[kind]
    normalized = str(ROOT / "specs" / "normalized-sgd.yaml")
    assert run(capsys, "lint", normalized, "--checkpoint", path) == (0, "", "")
    # roles from names and shapes are guesses: noted, not an error
    code, out, _ = run(capsys, "lint", USCION, "--checkpoint", path, "--strict")
    assert code == 0 and {TEXT_LINE.match(line).group("code") for line in out.splitlines()} == {"GO118"}
    code, out, _ = run(capsys, "lint", bad, "--checkpoint", path, "--format", "json")
    assert code == 1
    unmatched = sorted(re.search(r"parameter '([^']+)'", d["message"]).group(1)
                       for d in json.loads(out) if d["code"] == "GO101")
    model = checkpoints["model"]
    assert unmatched == sorted(n for n, _ in model.named_parameters() if not n.endswith(".weight"))


@pytest.mark.parametrize("kind", ["pt", "safetensors"])
def test_plan_from_a_checkpoint_uses_names_and_shapes(capsys, checkpoints, kind):
    normalized = str(ROOT / "specs" / "normalized-sgd.yaml")
    code, out, _ = run(capsys, "plan", normalized, "--checkpoint", checkpoints[kind], "--format", "json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    model = checkpoints["model"]
    assert {n: tuple(r["shape"]) for n, r in rows.items()} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    # a spec by roles: the guessed roles keep embeddings, head and norms off the spectral rule
    code, out, _ = run(capsys, "plan", str(ROOT / "specs" / "muon.yaml"), "--checkpoint", checkpoints[kind], "--format", "json")
    assert code == 0
    rules = {r["name"]: r["rule"] for r in json.loads(out)}
    assert rules["transformer.wte.weight"] == rules["transformer.wpe.weight"] == "embeddings"
    assert rules["lm_head.weight"] == "head" and rules["transformer.h.0.attn.c_attn.weight"] == "hidden"
    assert rules["transformer.h.0.ln_1.weight"] == rules["transformer.h.0.attn.c_attn.bias"] == "rest"


def test_checkpoint_reads_dtypes_and_skips_integer_tensors(tmp_path):
    from safetensors.torch import save_file

    from geomopt.compile.params import params_from_checkpoint

    tensors = {"w": torch.zeros(3, 2, dtype=torch.bfloat16), "steps": torch.zeros((), dtype=torch.int64),
               "b": torch.zeros(3, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    torch.save({"state_dict": tensors, "epoch": 3}, tmp_path / "m.pt")
    for name in ("m.safetensors", "m.pt"):
        infos = {p.name: p for p in params_from_checkpoint(tmp_path / name)}
        assert set(infos) == {"w", "b"}
        assert (infos["w"].shape, infos["w"].dtype, infos["w"].modules) == ((3, 2), "bfloat16", None)
        assert (infos["b"].shape, infos["b"].dtype) == ((3,), "float16")


def _safetensors_bytes(header) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("name, content", [
    ("garbage.pt", b"not a checkpoint at all\x00\x01"),
    ("text.pt", b"hello"),
    ("empty.pt", b""),
    ("garbage.safetensors", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]"),
    ("short.safetensors", b"\x01\x02"),
    ("huge-header.safetensors", b"\xff" * 16),
    ("bad-shape.safetensors", _safetensors_bytes({"w": {"dtype": "F32", "shape": 7, "data_offsets": [0, 0]}})),
    ("not-an-object.safetensors", _safetensors_bytes([1, 2])),
])
def test_unreadable_checkpoints_exit_2(capsys, tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    code, out, err = run(capsys, "lint", USCION, "--checkpoint", str(path))
    assert code == 2 and str(path) in err and out == ""


def test_checkpoint_that_is_not_a_state_dict_exits_2(capsys, tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], path)
    code, _, err = run(capsys, "lint", USCION, "--checkpoint", str(path))
    assert code == 2 and "expected a state dict" in err


# ---------------------------------------------------------------- plan


def test_plan_prints_the_table(capsys):
    code, out, err = run(capsys, "plan", USCION, "--model", "gpt")
    assert code == 0 and err == ""
    expected = compile_spec(USCION, MODELS["gpt"]()).table()
    assert out == expected + "\n"
    assert out.splitlines()[0].split()[:4] == ["parameter", "shape", "role", "rule"]


def test_plan_json(capsys):
    code, out, _ = run(capsys, "plan", USCION, "--model", "gpt", "--format", "json")
    assert code == 0
    rows = json.loads(out)
    plan = compile_spec(USCION, MODELS["gpt"]())
    assert [r["name"] for r in rows] == [p.name for p in plan]
    assert [r["bucket"] for r in rows] == [p.bucket for p in plan]
    assert all(not k.startswith("_") for r in rows for k in r)
    assert rows[0]["radius"] == pytest.approx(plan.params[0].radius)
    # the typed fragments print as their plain JSON form, not as a repr
    assert all(isinstance(r["geometry"], dict) and r["geometry"]["kind"] == p.geometry.kind
               and isinstance(r["direction"], dict) for r, p in zip(rows, plan))


def test_plan_with_errors_reports_them(capsys, bad):
    code, out, _ = run(capsys, "plan", bad, "--model", "mlp")
    assert code == 1 and "GO101" in out and "parameter" not in out.splitlines()[0][:10]


def test_plan_prints_warnings_to_stderr(capsys, warn):
    code, out, err = run(capsys, "plan", warn, "--model", "mlp")
    assert code == 0 and "GO102" in err and out.startswith("parameter")


# ---------------------------------------------------------------- fmt


def test_fmt_to_dsl_and_back_is_lossless(capsys, tmp_path):
    for path in SPECS:
        code, dsl, _ = run(capsys, "fmt", path, "--to", "dsl")
        assert code == 0
        assert geomopt.parse_spec(dsl, "dsl") == geomopt.load_spec(path)
        geom = tmp_path / (Path(path).stem + ".geom")
        geom.write_text(dsl, encoding="utf-8")
        code, yaml_text, _ = run(capsys, "fmt", str(geom), "--to", "yaml")
        assert code == 0 and geomopt.parse_spec(yaml_text, "yaml") == geomopt.load_spec(path)


def test_fmt_check(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    text = Path(USCION).read_text(encoding="utf-8")
    assert "{kind: newton_schulz}" in text
    # a default written out: not canonical (the shipped file itself is)
    path.write_text(text.replace("{kind: newton_schulz}", "{kind: newton_schulz, steps: 5}"), encoding="utf-8")
    code, _, err = run(capsys, "fmt", str(path), "--check")
    assert code == 1 and "would reformat" in err
    assert run(capsys, "fmt", str(path), "-o", str(path))[0] == 0
    assert run(capsys, "fmt", str(path), "--check") == (0, "", "")
    assert geomopt.load_spec(path) == geomopt.load_spec(USCION)
    # a yaml file is never formatted as DSL
    code, _, err = run(capsys, "fmt", str(path), "--check", "--to", "dsl")
    assert code == 1 and "to dsl" in err
    geom = tmp_path / "s.geom"
    assert run(capsys, "fmt", str(path), "--to", "dsl", "-o", str(geom))[0] == 0
    assert run(capsys, "fmt", str(geom), "--check") == (0, "", "")


def test_fmt_of_a_bad_spec_reports_and_fails(capsys, tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("geomopt: 1\n")
    code, out, _ = run(capsys, "fmt", str(path))
    assert code == 2 and "GO010" in out


# ---------------------------------------------------------------- schema


def test_schema_is_the_committed_file(capsys, tmp_path):
    code, out, _ = run(capsys, "schema")
    committed = (ROOT / "schema" / "geomopt-1.schema.json").read_text(encoding="utf-8")
    assert code == 0 and out == committed
    json.loads(out)
    assert run(capsys, "schema", "-o", str(tmp_path / "s.json"))[0] == 0
    assert (tmp_path / "s.json").read_text(encoding="utf-8") == committed


# ---------------------------------------------------------------- --model pkg.module:factory


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """A fresh module (unique name) in tmp_path, importable from the working directory."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))\n"
        "def broken():\n    raise RuntimeError('no weights here')\n"
        "def not_a_module():\n    return 42\n"
        "class Zoo:\n    @staticmethod\n    def tiny():\n        return torch.nn.Linear(2, 2)\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_model_factory_from_a_user_module(capsys, factory_module):
    code, out, _ = run(capsys, "plan", USCION, "--model", f"{factory_module}:make")
    assert code == 0 and "0.weight" in out and "1.bias" in out
    assert run(capsys, "lint", USCION, "--model", f"{factory_module}:Zoo.tiny")[0] == 0


@pytest.mark.parametrize("factory, needle", [
    ("broken", "the factory raised RuntimeError: no weights here"),
    ("not_a_module", "returned int, not a torch.nn.Module"),
    ("missing", "has no attribute 'missing'"),
])
def test_model_factory_mistakes_exit_2(capsys, factory_module, factory, needle):
    code, out, err = run(capsys, "lint", USCION, "--model", f"{factory_module}:{factory}")
    assert code == 2 and needle in err and out == ""


def test_model_module_that_fails_to_import_exits_2(capsys, tmp_path, monkeypatch):
    name = f"user_broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise ValueError('bad import')\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "lint", USCION, "--model", f"{name}:make")
    assert code == 2 and "ValueError: bad import" in err


# ---------------------------------------------------------------- no tracebacks


@pytest.mark.parametrize("content", [
    b"",  # empty
    b"geomopt: 2\nname: x\nrules: []\n",  # unsupported version
    b"geomopt: 1\nname: x\nrules:\n  - name: a\n    match: 're:('\n    geometry: {kind: euclidean}\n",  # bad regex
    b"geomopt: 1\nname: x\nname: y\n",  # duplicate key
    b"{{{{",  # not YAML
    b"geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '**'\n    lr: yes\n    geometry: {kind: euclidean}\n",
    "geomopt: 1\nname: \"\u00e9\"\nrules: 3\n".encode(),
    b"\xff\xfe\x00g\x00e",  # UTF-16 / binary
    b"- a\n- b\n",  # a list, not a mapping
    b"&a [*a, *a]",  # recursive alias
])
@pytest.mark.parametrize("command", ["lint", "plan", "fmt"])
def test_no_traceback_for_bad_specs(capsys, tmp_path, content, command):
    path = tmp_path / "user.yaml"
    path.write_bytes(content)
    argv = [command, str(path)] + (["--model", "mlp"] if command == "plan" else [])
    code, out, err = run(capsys, *argv)
    assert code in (1, 2)
    assert re.search(r"GO0\d\d", out + err)


@pytest.mark.parametrize("code_name", sorted(LANGUAGE_CODES) + sorted(RULES))
def test_every_code_is_explained(capsys, code_name):
    code, out, _ = run(capsys, "rule", code_name)
    assert code == 0 and out.startswith(code_name)


# ---------------------------------------------------------------- the entry point (subprocess)


def test_entry_point_runs_clean(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "geomopt", "lint", *SPECS, "--model", "gpt"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout


def test_entry_point_reports_user_mistakes_without_traceback(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\x00\x01\x02")
    proc = subprocess.run([sys.executable, "-m", "geomopt", "lint", "bin.yaml", "nope.yaml", "--model", "gpt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [TEXT_LINE.match(line).group("file", "code") for line in proc.stdout.splitlines()] == [
        ("bin.yaml", "GO010"), ("nope.yaml", "GO010")]


def test_lint_accepts_directories_as_linters_do(capsys, tmp_path):
    """`geomopt lint specs/*` meets specs/examples/: a directory stands for the spec files in it."""
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    (nested / "x.yaml").write_text((ROOT / "specs" / "uscion.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    (nested / "notes.txt").write_text("not a spec", encoding="utf-8")
    (tmp_path / "a" / "bad.geom").write_text("geomopt 1\nname \"x\"\nrule r match \"*\"\n", encoding="utf-8")
    code, out, _ = run(capsys, "lint", str(tmp_path / "a"))
    assert code == 1
    assert "bad.geom" in out and "notes.txt" not in out
    code, out, _ = run(capsys, "lint", *sorted(str(p) for p in (ROOT / "specs").iterdir()))
    assert code == 0, out


def test_lint_of_a_directory_without_specs_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a spec")
    code, out, err = run(capsys, "lint", str(tmp_path))
    assert code == 2 and out == "" and "no spec files (.yaml, .yml, .geom) found in" in err and "Traceback" not in err


def test_spec_text_is_accepted_where_a_path_is_expected():
    """A string with a line break cannot be a path: it is read as the spec itself (YAML, or the DSL
    when it opens with ``geomopt 1``), with positions in ``<string>``."""
    yaml_text = 'geomopt: 1\nname: t\nrules:\n  - {name: all, match: "**", geometry: {kind: euclidean}}\n'
    dsl_text = '# a comment\ngeomopt 1\nname "t"\nrule all match "**":\n    geometry euclidean\n'
    model = torch.nn.Linear(3, 2)
    for text in (yaml_text, dsl_text):
        opt = geomopt.GeomOptimizer(model, text)
        assert {g["rule"] for g in opt.param_groups} == {"all"}
    with pytest.raises(geomopt.SpecError, match="<string>:4:"):
        geomopt.GeomOptimizer(model, yaml_text.replace("euclidean", "euclidian"))


# ---------------------------------------------------------------- output files


UNWRITABLE = {  # what -o was given: (path, the reason the message gives)
    "full device": ("/dev/full", "No space left on device"),
    "missing folder": ("{tmp}/nonexistent/x/y.yaml", "No such file or directory"),
    "read-only proc file": ("/proc/version", ""),
    "a directory": ("{tmp}", "Is a directory"),
}


@pytest.mark.parametrize("where", sorted(UNWRITABLE))
@pytest.mark.parametrize("argv", [["schema"], ["fmt", USCION], ["init", "--model", "mlp"]],
                         ids=["schema", "fmt", "init"])
def test_unwritable_output_is_one_line_and_exit_2(capsys, tmp_path, argv, where):
    """Each wrote with Path.write_text and let OSError through: a traceback."""
    path, reason = UNWRITABLE[where]
    path = path.format(tmp=tmp_path)
    if path.startswith("/dev/") or path.startswith("/proc/"):
        if not Path(path).exists():
            pytest.skip(f"no {path} on this platform")
    extra = ["--force"] if argv[0] == "init" else []
    code, out, err = run(capsys, *argv, "-o", path, *extra)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1, err
    assert err.startswith(f"geomopt {argv[0]}: error: cannot write {path}: {reason}"), err
    assert "give -o a writable file" in err


def test_the_commands_beside_main_do_not_import_it():
    """main imports cli.lock (and demo, bench): their importing main back, even inside a function,
    was an import cycle. What they share is cli.status."""
    import ast

    modules = sorted(p.stem for p in (ROOT / "geomopt" / "cli").glob("*.py") if p.stem not in ("main", "__init__"))
    assert {"lock", "demo", "bench", "status"} <= set(modules)
    for module in modules:
        tree = ast.parse((ROOT / "geomopt" / "cli" / f"{module}.py").read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "geomopt.cli.main" not in imported, module
        assert module not in ("lock", "demo", "bench") or "geomopt.cli.status" in imported, module


LONG = "a" * 300  # over NAME_MAX: the system refuses to look the name up (OSError, File name too long)


@pytest.mark.parametrize("argv", [
    ["lint", f"{LONG}.yaml"], ["fmt", f"{LONG}.yaml"], ["explain", f"{LONG}.yaml", "x", "--model", "mlp"],
    ["plan", "muon", "--model", "mlp", "--check", f"{LONG}.json"],
    ["plan", "muon", "--model", "mlp", "--lock", f"{LONG}.json"],
    ["lint", "muon", "--checkpoint", f"{LONG}.pt"], ["init", "--model", "mlp", "-o", f"{LONG}.yaml"],
], ids=["lint", "fmt", "explain", "check", "lock", "checkpoint", "init"])
def test_a_file_name_too_long_is_exit_2_with_the_reason(capsys, tmp_path, monkeypatch, argv):
    """lint (Path.is_dir) and plan --check (the lock's is_dir) raised OSError: a traceback."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and "File name too long" in out + err, (code, out, err)


@pytest.mark.parametrize("header, data, needle", [
    ({"w": {"dtype": "F32", "shape": [1000000, 1000000], "data_offsets": [0, 16]}}, 16, "needs 4000000000000 bytes"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, 8, "holds 8 data bytes"),
    ({"w": {"dtype": "F32", "shape": [2, 2]}}, 16, "data_offsets None"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 4]}}, 16, "data_offsets [8, 4]"),
])
def test_a_safetensors_header_whose_tensors_exceed_the_file_is_refused(capsys, tmp_path, header, data, needle):
    """The header is all lint reads of a safetensors file: a tensor's shape must fit the bytes
    the file holds for it, or the plan describes a model that is not there."""
    path = tmp_path / "lying.safetensors"
    path.write_bytes(_safetensors_bytes(header) + b"\0" * data)
    code, out, err = run(capsys, "lint", USCION, "--checkpoint", str(path))
    assert code == 2 and out == "" and needle in err and "Traceback" not in err


def test_a_safetensors_file_saved_by_the_library_still_lints(capsys, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 5), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "ok.safetensors"))
    from geomopt.compile.params import params_from_checkpoint

    infos = {i.name: i for i in params_from_checkpoint(tmp_path / "ok.safetensors")}
    assert (infos["w"].shape, infos["b"].shape) == ((3, 5), (3,))
