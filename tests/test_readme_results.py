"""The result tables of the README and the docs are generated from the committed results
(scripts/readme_tables.py), and running the demo or an example from inside a checkout leaves it
clean."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_tables.py"
EXAMPLES = ("grokking", "digits_cnn", "char_gpt", "moe", "plot_preconditioners")


@pytest.fixture(scope="module")
def tables():
    return load_script(SCRIPT, "readme_tables")


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *args], capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- the README and the committed JSON


def _docs_copy(tmp_path: Path) -> Path:
    """A copy of docs/ (the pages with marked parts), to check or rewrite instead of the real one."""
    return Path(shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("hooks")))


def test_readme_agrees_with_the_committed_results():
    proc = _check()
    assert proc.returncode == 0, (
        "README.md or docs/ disagree with the committed results; run `python scripts/readme_tables.py`\n"
        + proc.stdout + proc.stderr)


def test_every_renderer_has_a_marker_and_every_results_file_is_quoted(tables):
    keys = [m["key"] for path in tables.targets() for m in tables.MARKER.finditer(path.read_text(encoding="utf-8"))]
    assert tables.targets()[0] == ROOT / "README.md" and len(tables.targets()) > 1  # the README and docs/*.md
    assert sorted(keys) == sorted(tables.RENDERERS)  # each once, in one of the files
    stems = {key.split(":")[0].replace("moe-routing", "moe") for key in keys if not key.startswith("bench:")}
    committed = {p.stem for p in (ROOT / "examples" / "results").glob("*.json")}
    assert committed <= stems, f"results the README does not quote: {committed - stems}"


def test_check_fails_on_a_stale_number(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- results:demo -->")
    row = readme.index("| spectral-clip", start)
    cells = readme[row:readme.index("\n", row)].split(" | ")
    cells[1] = "0.123"  # the final validation loss, no longer the JSON's
    stale = readme[:row] + " | ".join(cells) + readme[readme.index("\n", row):]
    (tmp_path / "README.md").write_text(stale, encoding="utf-8")
    docs = _docs_copy(tmp_path)
    proc = _check("--readme", str(tmp_path / "README.md"), "--docs", str(docs))
    assert proc.returncode == 1 and "-" + " | ".join(cells) in proc.stdout
    # the rewrite restores it
    assert subprocess.run([sys.executable, str(SCRIPT), "--readme", str(tmp_path / "README.md"), "--docs", str(docs)],
                          capture_output=True, timeout=60).returncode == 0
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme


def test_check_fails_on_a_missing_marker(tmp_path):
    docs = _docs_copy(tmp_path)
    page = docs / "examples" / "digits.md"
    page.write_text(page.read_text(encoding="utf-8").replace("<!-- results:digits_cnn:prox-cost -->", "", 1), encoding="utf-8")
    proc = _check("--docs", str(docs))
    assert proc.returncode == 1 and "digits_cnn:prox-cost" in proc.stderr


def test_check_fails_on_a_key_marked_twice(tmp_path):
    docs = _docs_copy(tmp_path)
    (docs / "extra.md").write_text("<!-- results:digits_cnn:acc-range -->x<!-- /results -->\n", encoding="utf-8")
    proc = _check("--docs", str(docs))
    assert proc.returncode == 1 and "'digits_cnn:acc-range' is marked 2 times" in proc.stderr


def test_a_benchmark_quote_copies_the_log_verbatim(tables):
    text = tables.RENDERERS["bench:compile"](tables.Records(tables.RESULTS, committed=True))
    log = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    assert text.startswith("**Compile** (`benchmarks/RESULTS.md`)")
    assert all(line in log for line in text.splitlines()[1:] if line)  # every line quoted as the log has it


# ---------------------------------------------------------------- rendering


def _demo_record() -> dict:
    return json.loads((ROOT / "examples" / "results" / "demo.json").read_text(encoding="utf-8"))


def _records(tables, tmp_path: Path, **records: dict):
    for stem, rec in records.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(rec), encoding="utf-8")
    return tables.Records(tmp_path, committed=False)


def test_times_render_as_ranges_with_the_machine(tables, tmp_path):
    rec = copy.deepcopy(_demo_record())
    rec["results"][0]["seconds_runs"] = [47.6, 40.2, 52.9]
    rec["results"][1]["seconds_runs"] = [38.7, 38.9, 39.2]
    rec.update(machine=dict(cpu="Example CPU 9000", cores=8, threads=4, torch="2.13.0+cpu"), date="2026-12-01T10:00:00+00:00",
               source=dict(commit="abc1234", dirty=False), repeats_identical=True)
    text = tables.demo(_records(tables, tmp_path, demo=rec))
    assert "| 40–53 |" in text and "| 39 |" in text  # min–max; one number where both ends round alike
    assert "min–max over 3 runs of each optimizer's training" in text
    assert "on Example CPU 9000 (8 cores, 4 torch threads), torch 2.13.0+cpu" in text
    assert "2026-12-01, geomopt abc1234." in text


def test_a_single_time_without_a_machine_says_so(tables, tmp_path):
    rec = copy.deepcopy(_demo_record())  # as an older record reads: one time, no machine
    rec.pop("machine", None)
    for run in rec["results"]:
        run.pop("seconds_runs", None)
    text = tables.demo(_records(tables, tmp_path, demo=rec))
    assert "one run of each optimizer's training, on a machine the record does not name" in text


def test_a_sentence_that_no_longer_fits_is_reported(tables, tmp_path):
    rec = json.loads((ROOT / "examples" / "results" / "grokking.json").read_text(encoding="utf-8"))
    clip = rec["results"]["summary"]["uScion + spectral clip"]
    clip["reached"] -= 1  # a clipped seed that never groks: "every seed groks, in …" would be false
    records = _records(tables, tmp_path, grokking=rec)
    with pytest.raises(tables.Stale):
        tables.grokking_clip_epochs(records)
    readme = "groks, in <!-- results:grokking:clip-epochs -->60–106 epochs (median 69)<!-- /results -->."
    new, problems = tables.regenerate(readme, records)
    assert new == readme and problems and "grokking:clip-epochs" in problems[0]


def test_a_quick_record_is_not_quoted(tables, tmp_path):
    rec = dict(_demo_record(), quick=True)
    records = _records(tables, tmp_path, demo=rec)
    records.committed = True
    with pytest.raises(tables.Unusable, match="--quick"):
        tables.demo(records)


# ---------------------------------------------------------------- output folders


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_outputs_default_to_runs_and_the_committed_results_need_record(name, tmp_path, monkeypatch):
    module = load_script(ROOT / "examples" / f"{name}.py", f"example_{name}")
    common = sys.modules["_common"]
    stem = "preconditioners" if name == "plot_preconditioners" else name
    parser = module.build_parser()
    monkeypatch.chdir(tmp_path)
    assert common.resolve_output(parser, parser.parse_args([]), stem) == Path("runs") / stem
    assert common.resolve_output(parser, parser.parse_args(["--record"]), stem) == common.RESULTS
    assert common.resolve_output(parser, parser.parse_args(["--record", "--out", "x"]), stem) == Path("x")
    with pytest.raises(SystemExit) as exc:
        common.resolve_output(parser, parser.parse_args(["--out", str(common.RESULTS)]), stem)
    assert exc.value.code == 2
    if name in ("char_gpt", "moe"):  # single-seed trainings: record mode times each three times
        args = parser.parse_args(["--record", "--out", "x"])
        common.resolve_output(parser, args, stem)
        assert args.repeats == 3
    assert not (tmp_path / "runs").exists()  # choosing the folder writes nothing


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=geomopt-test", "-c", "user.email=test@example.invalid",
                           "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", *args],
                          cwd=repo, env=env, capture_output=True, text=True, check=True, timeout=120).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_demo_and_an_example_leave_a_checkout_clean(tmp_path):
    """A snapshot of this working tree (tracked and untracked, not ignored files) as a fresh git
    repository; `geomopt demo --quick` (5 steps) and `examples/grokking.py --quick` (1 epoch) run inside it
    with their default output folders, from its own code; afterwards `git status --porcelain` is
    empty."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True, timeout=60).stdout
    repo = tmp_path / "checkout"
    for name in filter(None, listed.split(b"\0")):
        rel = os.fsdecode(name)
        src, dst = ROOT / rel, repo / rel
        if not (src.exists() or src.is_symlink()) or (src.is_dir() and not src.is_symlink()):
            continue  # deleted in the working tree, or a submodule
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "snapshot")
    assert _git(repo, "status", "--porcelain") == ""

    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(PYTHONPATH=str(repo), TRANSFORMERS_VERBOSITY="error", MPLBACKEND="Agg")

    def run(*cmd: str) -> str:
        proc = subprocess.run([sys.executable, *cmd], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    where = run("-c", "import geomopt.cli.demo as d; print(d.__file__); print(d.output_dir(None, True, 'demo'))")
    assert where.split() == [str(repo / "geomopt" / "cli" / "demo.py"), str(repo / "examples" / "results")]
    run("-m", "geomopt.cli.main", "demo", "--quick", "--steps", "5", "--no-progress")  # 5 steps: only the files matter
    run("examples/grokking.py", "--quick", "--max-epochs", "1")  # 1 epoch (quick: 3): only the files matter

    assert _git(repo, "status", "--porcelain") == ""
    assert (repo / "runs" / "demo" / "demo.png").is_file() and (repo / "runs" / "demo" / "demo.json").is_file()
    assert (repo / "runs" / "grokking" / "grokking.json").is_file()
    assert "!! runs/" in _git(repo, "status", "--porcelain", "--ignored").splitlines()
