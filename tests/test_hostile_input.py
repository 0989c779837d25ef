"""Hostile input is refused fast, with a clear error: name patterns match in time linear in the name
(geomopt.spec.patterns), and spec files, checkpoints and literals are bounded before they are read.

Calls that hung (or ate memory) before their fix run in a subprocess with a generous timeout: the
bound is minutes or forever for the old code, a second or two now."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geomopt.cli.main import main
from geomopt.compile import as_spec
from geomopt.compile.match import Matcher, ParamInfo
from geomopt.compile.params import params_from_checkpoint
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.model import Match
from geomopt.spec.patterns import _glob_regex, _glob_tokens, _re2_matcher, compile_pattern, pattern_error
from geomopt.spec.source import MAX_BYTES
from geomopt.spec.validate import load_spec, parse_spec, parse_text

ROOT = Path(__file__).resolve().parents[1]
HAS_FIFO = hasattr(os, "mkfifo")


def run(capsys, *argv):
    """(exit status, stdout, stderr) of one in-process CLI run."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def subprocess_python(code: str, timeout: float, *, memory: int | None = None) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter on this checkout; fails the test if it outlives ``timeout``.
    ``memory``: an address-space bound in bytes (so that reading a device endlessly fails fast)."""
    def limit():  # pragma: no cover - runs in the child
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit if memory else None)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish in {timeout} s (hangs)")


def geomopt_cli(*argv, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, "-m", "geomopt", *map(str, argv)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"geomopt {' '.join(map(str, argv))} did not finish in {timeout} s (hangs)")


def spec_yaml(match: str, roles: str = "") -> str:
    return (f"geomopt: 1\nname: hostile\n{roles}rules:\n  - name: a\n    match: {json.dumps(match)}\n"
            f"    geometry: {{kind: euclidean}}\n"
            f"  - name: rest\n    match: \"**\"\n    geometry: {{kind: euclidean}}\n")


# ---------------------------------------------------------------- A. matching is bounded

PLAN = """
    import json, sys
    from geomopt.compile import ParamInfo
    from geomopt.compile.compiler import plan_from_infos
    from geomopt.spec.validate import parse_spec
    spec = parse_spec({text!r})
    infos = [ParamInfo(name={name!r}, shape=(2, 2)), ParamInfo(name="w", shape=(2,))]
    plan = plan_from_infos(spec, infos)
    print(json.dumps([p.rule for p in plan.params]))
"""


def test_glob_with_many_double_stars_matches_in_linear_time():
    """`**a**a**a**a**a**a**b` was seven nested `.*`: past 60 s on an 80-character name."""
    text = spec_yaml("**a**a**a**a**a**a**b")
    proc = subprocess_python(PLAN.format(text=text, name="a" * 79 + "c"), timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["rest", "rest"]
    assert compile_pattern("**a**a**a**a**a**a**b").engine == "re2"


@pytest.mark.parametrize("regex, name", [
    ("(a+)+$", "a" * 5000 + "!"),
    ("(x|x)*y", "x" * 5000),
    ("(a|aa)+b", "a" * 5000),
], ids=["nested-plus", "same-alternatives", "overlapping-alternatives"])
@pytest.mark.parametrize("where", ["match", "roles"])
def test_catastrophic_regexes_match_in_linear_time(regex, name, where):
    """Exponential backtracking on Python's engine: each ran for hours on a 5,000-character name."""
    if where == "match":
        text = spec_yaml("re:" + regex)
    else:  # a roles: pattern is matched against every tensor when the plan reads roles
        text = spec_yaml("**", roles=f"roles: {{head: [{json.dumps('re:' + regex)}]}}\n")
    proc = subprocess_python(PLAN.format(text=text, name=name), timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == (["rest", "rest"] if where == "match" else ["a", "a"])


@pytest.mark.parametrize("fmt", ["yaml", "dsl"])
@pytest.mark.parametrize("where", ["match", "roles"])
def test_repeat_count_overflow_is_a_positioned_error(fmt, where, tmp_path, capsys):
    """`re:a{4294967296}` raised OverflowError (a traceback) from Python's regex compiler."""
    pattern = "re:a{4294967296}"
    if fmt == "yaml":
        text = (spec_yaml(pattern) if where == "match"
                else spec_yaml("**", roles=f"roles: {{head: [{json.dumps(pattern)}]}}\n"))
        path = tmp_path / "s.yaml"
    else:
        roles = f"roles head=[{json.dumps(pattern)}]\n" if where == "roles" else ""
        match = json.dumps(pattern if where == "match" else "**")
        text = f'geomopt 1\nname "x"\n{roles}rule a match {match}:\n    geometry euclidean\n'
        path = tmp_path / "s.geom"
    path.write_text(text, encoding="utf-8")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "4294967296" in ln)
    col = text.splitlines()[line - 1].index('"re:') + 1
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (d,) = info.value.diagnostics
    assert (d.code, d.file, d.line, d.col) == ("GO007", str(path), line, col)
    assert "repeat count is too large" in d.message and "1000" in d.message
    code, out, err = run(capsys, "lint", path)
    assert code == 1 and f"{path}:{line}:{col}: error GO007" in out and "Traceback" not in out + err


@pytest.mark.parametrize("regex, feature", [
    (r"(a)\\1", "backreferences"),
    ("(?=a)a", "lookaround"),
    ("(?<!x)a", "lookaround"),
    ("a*+", "possessive"),
])
def test_regex_features_the_linear_engine_lacks_are_refused_where_written(regex, feature, tmp_path):
    path = tmp_path / "s.yaml"
    text = spec_yaml("**", roles=f'roles:\n  head: ["w", "re:{regex}"]\n')
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (d,) = info.value.diagnostics
    assert (d.code, d.line, d.col) == ("GO007", 4, 15)  # the second pattern of the list
    assert "RE2" in d.message and feature in d.message and "rewrite the pattern" in d.message
    with pytest.raises(ValueError, match="RE2"):
        Match(name="re:" + regex.replace("\\\\", "\\"))


def test_refused_pattern_message_is_one_short_line():
    message = pattern_error("re:" + "(" * 100_000 + ")" * 100_000)
    assert message is not None and "\n" not in message and len(message) < 300 and "200000 characters" in message


def test_common_patterns_run_on_pythons_engine_and_hostile_ones_on_re2():
    """Speed: a call on RE2 costs about ten times Python's, so patterns Python's engine provably
    runs in linear time stay there; the others go to RE2."""
    python = ["**", "**.weight", "h.*.weight", "**.ln_*.bias", "blocks.?.adapter.down.weight", "layers.1.**",
              "*head.weight", "**.experts.**", r"re:blocks\.\d+\.attn\.v\.weight", r"re:(lm_)?head\.weight",
              r"re:.*\.attn\.[qkv]\.bias", r"re:layers\.\d+\.mlp\..*"]
    linear = ["**a**a**b", "*a*b", "**.a.**.b", "re:(a+)+$", "re:(x|x)*y", "re:.*a.*b", r"re:(\w+\.)*weight"]
    assert [compile_pattern(p).engine for p in python] == ["re"] * len(python)
    assert [compile_pattern(p).engine for p in linear] == ["re2"] * len(linear)


def _old_glob(pattern: str) -> re.Pattern:
    """The glob's meaning before this module (``**`` crossing line breaks): the reference the engines
    must agree with."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        if pattern.startswith("**.", i):
            out.append(r"(?:.*\.)?")
            i += 3
        elif pattern.startswith(".**", i) and i + 3 == n:
            out.append(r"(?:\..*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] in "*?":
            out.append(r"[^.]*" if pattern[i] == "*" else r"[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def test_both_engines_keep_the_meaning_of_globs():
    rng = random.Random(0)
    atoms = ["*", "**", "?", "a", "b", ".", "**.", ".**", "\n", " ", "-", "é", "[", "+", "{"]
    chars = "ab.\n é-[+{c"
    for _ in range(1500):
        pattern = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 8)))
        ref, fast, slow = _old_glob(pattern).fullmatch, compile_pattern(pattern).fullmatch, _re2_matcher(
            pattern, _glob_regex(_glob_tokens(pattern)))
        for _ in range(20):
            name = "".join(rng.choice(chars) for _ in range(rng.randint(0, 10)))
            expected = ref(name) is not None
            assert (fast(name) is not None) == expected == (slow(name) is not None), (pattern, name)


def test_regexes_keep_pythons_meaning():
    """Python's syntax and meaning, Unicode classes included, on both engines (``$`` at the end here;
    anywhere in ``tests/test_regex_re2.py``)."""
    rng = random.Random(1)
    atoms = ["a", "b", r"\.", ".", "[ab]", "[^.]", r"\d", "(a|b)", "(ab)?", "a*", "b+", ".*", "[^.]*", r"\d+", "a?",
             "(a|ab)", "a{2,5}", r"\w+", r"(?:a\.)?", r"\n", "[^a]*", r"\W", "[a-c]", r"[\d.]", "a{,2}", r"\Z",
             "[-a]", "(?P<x>a)", "b*?", r"\-", " ", "é", r"\é", r"\ ", r"\N{LATIN SMALL LETTER A}", r"[\b.]",
             r"\u0062", r"\s", r"[\s.]", r"[\w]", r"[^\d]", r"\S"]
    chars = "ab.1\n_ -é٣\u2003\b\t"
    engines = set()
    for _ in range(2000):
        regex = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 6))) + rng.choice(["", "$"])
        try:
            ref = re.compile(regex).fullmatch
        except re.error:
            continue
        compiled = compile_pattern("re:" + regex)
        engines.add(compiled.engine)
        for _ in range(20):
            name = "".join(rng.choice(chars) for _ in range(rng.randint(0, 8)))
            assert (compiled.fullmatch(name) is not None) == (ref(name) is not None), (regex, name)
    assert engines == {"re", "re2"}


def test_patterns_on_pythons_engine_stay_linear_on_long_names():
    """Patterns kept on Python's engine, against names built to make a backtracking engine rescan:
    quadratic time would take minutes at 200,000 characters (`**.a.**` did, before names with a
    line break went to RE2)."""
    proc = subprocess_python("""
        from geomopt.spec.patterns import compile_pattern
        cases = [("**.a.**", "a." * 100_000 + "\\n"), ("**a.", "ab" * 100_000 + "\\n."),
                 ("*head.weight", "h" * 200_000),
                 ("**.ln_*.bias", "ln_." * 50_000 + "x"), ("h.*.weight", "h." + "x" * 200_000),
                 (r"re:.*\\d(?:a\\.)?", "a.b" * 70_000), (r"re:layers\\.\\d+\\.mlp\\..*", "layers." + "1" * 200_000),
                 (r"re:\\d.*(ab)?", "1111." * 40_000 + "\\n.")]
        for pattern, name in cases:
            compiled = compile_pattern(pattern)
            assert compiled.engine == "re", pattern
            compiled.fullmatch(name)
        print("ok")
    """, timeout=20)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_name_with_a_lone_surrogate_is_matched_on_re2():
    """RE2 reads UTF-8: a lone surrogate (which has none) stands in as one character."""
    pattern = compile_pattern("**a**?c")
    assert pattern.engine == "re2"
    assert pattern.fullmatch("a\ud800c") is not None and pattern.fullmatch("a\ud800") is None
    assert Matcher(Match(name="**a**?c")).select([ParamInfo(name="xa\udc80c", shape=(1,))]) == ([0], [])


# ---------------------------------------------------------------- B. files and literals


@pytest.mark.skipif(not HAS_FIFO, reason="no FIFOs on this platform")
@pytest.mark.parametrize("command", ["lint", "fmt"])
def test_fifo_as_a_spec_is_refused_without_blocking(command, tmp_path):
    """Reading a FIFO waits for a writer: forever."""
    os.mkfifo(tmp_path / "spec.yaml")
    proc = geomopt_cli(command, "spec.yaml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert ("spec.yaml:1:1: error GO010 cannot read spec: a FIFO (named pipe), not a regular file; give a .yaml, "
            ".yml or .geom file") in proc.stdout


@pytest.mark.skipif(not HAS_FIFO, reason="no FIFOs on this platform")
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fifo_as_a_checkpoint_is_refused_without_blocking(suffix, tmp_path):
    os.mkfifo(tmp_path / f"ckpt{suffix}")
    proc = geomopt_cli("lint", "muon", "--checkpoint", f"ckpt{suffix}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (f"geomopt lint: error: cannot read checkpoint ckpt{suffix}: a FIFO (named pipe), not a regular file; "
            f"give a .pt, .pth, .bin or .safetensors file") in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_spec_linked_to_dev_zero_is_refused_before_reading(tmp_path):
    """It was read whole (endlessly) before the size check: MemoryError, after eating the memory."""
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    proc = subprocess_python("""
        import sys
        from geomopt.cli.main import main
        sys.exit(main(["lint", "zero.yaml"]))
    """.replace("zero.yaml", str(tmp_path / "zero.yaml")), timeout=60, memory=3 << 30)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "MemoryError" not in proc.stderr
    assert "zero.yaml:1:1: error GO010 cannot read spec: a character device, not a regular file" in proc.stdout
    with pytest.raises(OSError, match="a character device, not a regular file"):
        params_from_checkpoint(tmp_path / "zero.yaml")


def test_directory_named_like_a_spec_is_refused(tmp_path, capsys):
    (tmp_path / "d.geom").mkdir()
    with pytest.raises(SpecError, match="cannot read spec: a directory, not a regular file"):
        load_spec(tmp_path / "d.geom")


def test_spec_over_the_limit_is_refused_by_its_size(tmp_path):
    """It was read whole before its size was checked: a 4 GiB file, 4 GiB of memory."""
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:  # sparse: refused by its size, never read
        f.truncate(4 << 30)
    proc = subprocess_python(f"""
        from geomopt.spec.validate import load_spec
        from geomopt.spec.diagnostics import SpecError
        try:
            load_spec({str(path)!r})
        except SpecError as exc:
            print(exc)
    """, timeout=60, memory=2 << 30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"{path}:1:1: error GO010 spec too large ({4 << 30} bytes; the limit is "
                                   f"{MAX_BYTES}): split it, or build on a base spec with 'extends'")


@pytest.mark.parametrize("fmt, text, where", [
    ("yaml", "geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '**'\n    lr: {n}\n"
             "    geometry: {{kind: euclidean}}\n", (6, 9)),
    ("yaml", "geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '**'\n    lr: !!int {n}\n"
             "    geometry: {{kind: euclidean}}\n", (6, 9)),
    ("yaml", "geomopt: {n}\nname: x\n", (1, 10)),
    ("dsl", 'geomopt 1\nname "x"\nrule a match "**":\n    geometry euclidean\n    lr={n}\n', (5, 8)),
    ("dsl", 'geomopt {n}\nname "x"\n', (1, 9)),
], ids=["yaml-value", "yaml-tagged", "yaml-version", "dsl-value", "dsl-version"])
def test_integer_literal_over_python_limit_is_a_positioned_error(fmt, text, where, tmp_path, capsys):
    """int() of more than 4,300 digits raised ValueError (a traceback)."""
    path = tmp_path / ("s.yaml" if fmt == "yaml" else "s.geom")
    path.write_text(text.format(n="7" * 5000), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (d,) = info.value.diagnostics
    assert (d.code, d.line, d.col) == ("GO010", *where)
    assert d.message == ("integer literal too long (5,000 digits; at most 4,300): no spec value needs so many; "
                         "check the value")
    code, out, err = run(capsys, "lint", path)
    assert code == 2 and f"{path}:{where[0]}:{where[1]}: error GO010 integer literal too long" in out
    assert "Traceback" not in out + err


def test_hexadecimal_literal_too_large_to_print_is_refused():
    """Python reads hexadecimal digits without bound, but could not print the value in a message."""
    text = "geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '**'\n    shape: [0x" + "f" * 4000 + "]\n"
    with pytest.raises(SpecError, match=r"s:6:13: error GO010 integer literal too large \(more than 4,300"):
        parse_spec(text, file="s")
    assert parse_text(text.replace("f" * 4000, "f" * 3000)).data["rules"][0]["shape"] == [16 ** 3000 - 1]


def test_safetensors_header_nested_deeply_is_refused(tmp_path, capsys):
    """json.loads recursed once per level: RecursionError (a traceback) at 100,000 levels."""
    header = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="not a safetensors file \\(header nested too deeply\\)"):
        params_from_checkpoint(path)
    code, out, err = run(capsys, "lint", "muon", "--checkpoint", path)
    assert code == 2 and "header nested too deeply" in err and "Traceback" not in out + err


DSL = 'geomopt 1\nname "bom"\nrule all match "**":\n    geometry euclidean\n'
YAML = "geomopt: 1\nname: bom\nrules:\n  - name: all\n    match: '**'\n    geometry: {kind: euclidean}\n"


@pytest.mark.parametrize("suffix, text", [(".geom", DSL), (".yaml", YAML)], ids=["dsl", "yaml"])
def test_byte_order_mark_is_accepted_and_dropped(suffix, text, tmp_path, capsys):
    path = tmp_path / f"s{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    spec = load_spec(path)
    assert spec == parse_spec(text, "dsl" if suffix == ".geom" else "yaml") and spec.name == "bom"
    code, out, _ = run(capsys, "fmt", path)
    assert code == 0 and not out.startswith("\ufeff") and out == run(capsys, "fmt", _plain(tmp_path, suffix, text))[1]
    assert run(capsys, "fmt", path, "--check")[0] == 1  # canonical form has no BOM


def _plain(tmp_path: Path, suffix: str, text: str) -> Path:
    path = tmp_path / f"plain{suffix}"
    path.write_text(text, encoding="utf-8")
    return path


def test_byte_order_mark_keeps_positions_and_dsl_text_is_read_as_dsl():
    bad = "\ufeff" + DSL.replace("euclidean", "eucldean")
    with pytest.raises(SpecError) as info:
        parse_spec(bad, "dsl")
    assert (info.value.diagnostics[0].line, info.value.diagnostics[0].col) == (4, 14)
    with pytest.raises(SpecError, match="<spec>:1:10: error GO008"):  # columns count from after the BOM
        parse_spec("\ufeffgeomopt: 2\n", "yaml")
    assert as_spec("\ufeff" + DSL).name == "bom" == as_spec("\ufeff# a comment\n" + DSL).name


def test_fmt_refuses_output_that_lint_would_refuse(tmp_path, capsys):
    """A DSL spec within the limit whose canonical form is over it (a raw control character, one
    byte, prints as the escape \\u0001, six): fmt printed or wrote it, and lint refused the result."""
    path = tmp_path / "s.geom"
    path.write_text('geomopt 1\nname "x"\ndescription "' + "\x01" * 200_000 + '"\n'
                    'rule all match "**":\n    geometry euclidean\n', encoding="utf-8")
    assert path.stat().st_size < MAX_BYTES
    code, out, err = run(capsys, "fmt", path, "-o", tmp_path / "out.geom")
    assert code == 2 and not (tmp_path / "out.geom").exists() and "Traceback" not in out + err
    assert err.startswith(f"geomopt fmt: error: {path}: the formatted spec would be 1200") and str(MAX_BYTES) in err
    code, out, _ = run(capsys, "fmt", path)
    assert code == 2 and out == ""
    code, out, _ = run(capsys, "fmt", path, "--to", "yaml")  # as YAML (\\x01, four bytes) it fits
    assert code == 0 and len(out.encode()) <= MAX_BYTES and load_spec(path) == parse_spec(out)


# ---------------------------------------------------------------- C. lock files


LOCK_READ = """
    import sys
    from geomopt.cli.main import main
    sys.exit(main(["plan", "muon", "--model", "mlp", "--check", {path!r}]))
"""
LOCK_EXPECT = """
    import geomopt
    from geomopt.compile.lock import LockError
    from geomopt.models import get_model
    try:
        geomopt.GeomOptimizer(get_model("mlp"), "muon", expect={path!r})
    except LockError as exc:
        print(exc)
"""


def _not_a_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A lock path that names no regular file, and what the error calls it."""
    path = tmp_path / "routing.lock.json"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "a FIFO (named pipe), not a regular file"
    if kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
        return path, "a character device, not a regular file"
    return Path(kind), "a character device, not a regular file"


@pytest.mark.skipif(not HAS_FIFO or not os.path.exists("/dev/zero"), reason="no FIFOs or devices on this platform")
@pytest.mark.parametrize("kind, how", [(kind, "plan --check") for kind in ("fifo", "/dev/zero", "/dev/urandom",
                                                                        "link to /dev/zero")]
                         + [("fifo", "expect="), ("/dev/zero", "expect=")])
def test_lock_that_is_no_regular_file_is_refused_before_reading(tmp_path, kind, how):
    """A FIFO blocked `plan --check` and `expect=` forever; a device was read until memory ran out."""
    path, what = _not_a_file(tmp_path, kind)
    code = (LOCK_READ if how == "plan --check" else LOCK_EXPECT).format(path=str(path))
    proc = subprocess_python(code, timeout=30, memory=3 << 30)
    assert "Traceback" not in proc.stdout + proc.stderr and "MemoryError" not in proc.stderr
    message = f"{path}: cannot read the lock: {what}; give the file `geomopt plan SPEC --model … --lock FILE` wrote"
    if how == "plan --check":
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"geomopt plan: error: {message}\n"
    else:
        assert proc.returncode == 0 and proc.stdout == message + "\n", proc.stderr


def test_lock_over_the_size_bound_is_refused_by_its_size(tmp_path):
    """A lock was read whole whatever its size: a 4 GiB file, 4 GiB of memory (and more to parse)."""
    from geomopt.compile.lock import MAX_LOCK_BYTES

    path = tmp_path / "big.lock.json"
    with path.open("wb") as f:  # sparse: refused by its size, never read
        f.truncate(4 << 30)
    proc = subprocess_python(LOCK_READ.format(path=str(path)), timeout=60, memory=2 << 30)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"geomopt plan: error: {path}: lock too large ({4 << 30} bytes; the limit is "
                           f"{MAX_LOCK_BYTES}): give the file `geomopt plan SPEC --model … --lock FILE` wrote\n")


@pytest.mark.parametrize("text, where, message", [
    ("[" * 100_000 + "]" * 100_000, "1:17", "JSON nested too deeply (more than 16 levels; a lock nests 4)"),
    ('{\n  "geomopt-lock": ' + "[" * 50 + "]" * 50 + "\n}\n", "2:34", "JSON nested too deeply (more than 16 levels"),
    ('{\n  "geomopt-lock": ' + "7" * 5000 + "\n}\n", "2:19",
     "a number of 5,000 digits (at most 4,300; a lock's numbers are tensor sizes)"),
    ('{"a": "' + "1" * 5000 + '", "b": -' + "2" * 5000 + "}", "1:5016",
     "a number of 5,000 digits (at most 4,300; a lock's numbers are tensor sizes)"),
    ('{"a": "' + "]" * 100_000 + '", "b": ' + "[" * 100_000 + "]" * 100_000 + "}", "1:100031",
     "JSON nested too deeply (more than 16 levels"),
], ids=["deep array", "deep value", "long integer", "long negative after a long string", "depth behind a string"])
def test_lock_json_is_bounded_and_the_refusal_positioned(tmp_path, capsys, text, where, message):
    """json.loads recursed once per level (RecursionError at 100,000) and int() refused 5,000 digits
    (ValueError): both tracebacks."""
    from geomopt.compile.lock import LockError, read_lock

    path = tmp_path / "routing.lock.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(LockError) as info:
        read_lock(path)
    assert str(info.value).startswith(f"{path}:{where}: {message}"), str(info.value)
    code, out, err = run(capsys, "plan", "muon", "--model", "mlp", "--check", path)
    assert code == 2 and out == "" and err.startswith(f"geomopt plan: error: {path}:{where}: ")
    assert err.count("\n") == 1 and "Traceback" not in err
