"""The thread count of a training run: chosen by a probe of its own step (geomopt/cli/threads.py),
or by --threads / OMP_NUM_THREADS; printed with the machine's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from geomopt.cli.threads import ThreadChoice, choose_threads, fastest_threads, usable_cores


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """A step whose duration depends on torch's thread count, timed by a clock the step advances."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds, self.now, self.calls = seconds, 0.0, {n: 0 for n in seconds}

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        n = torch.get_num_threads()
        self.calls[n] += 1
        self.now += self.seconds[n]


def probe(seconds: dict[int, float], **kw):
    m = FakeMachine(seconds)
    chosen, medians, stopped = fastest_threads(m.step, sorted(seconds), clock=m.clock, **kw)
    return chosen, medians, stopped, m.calls


def test_the_fastest_count_is_chosen_and_left_set():
    chosen, medians, stopped, calls = probe({1: 0.040, 2: 0.020, 3: 0.030})
    assert chosen == 2 and torch.get_num_threads() == 2
    assert medians == pytest.approx({1: 0.040, 2: 0.020, 3: 0.030}) and not stopped
    assert calls == {1: 7, 2: 7, 3: 7}  # 2 warm-up + 5 timed steps at each count


def test_more_threads_must_be_clearly_faster():
    # 2 threads 5% faster: within the 10% tolerance, so the fewer threads win; 20% faster: 2 win
    assert probe({1: 0.100, 2: 0.095})[0] == 1
    assert probe({1: 0.100, 2: 0.080})[0] == 2
    assert probe({1: 0.100, 2: 0.080}, tolerance=0.30)[0] == 1


def test_a_count_far_behind_stops_early_and_is_never_chosen():
    # on a busy machine two threads spin-wait: 60x slower; the probe gives up on its first step
    chosen, medians, stopped, calls = probe({1: 0.040, 2: 2.4})
    assert chosen == 1 and torch.get_num_threads() == 1
    assert stopped == {2} and calls[2] == 1 and medians[2] == pytest.approx(2.4)
    # stopped at the step whose running sum passes 3x the best count's total (3 * 7 steps * 0.04 s = 0.84 s)
    assert probe({1: 0.040, 2: 0.2})[3][2] == 5
    assert probe({1: 0.040, 2: 0.1})[3][2] == 7 and 2 not in probe({1: 0.040, 2: 0.1})[2]


def test_probe_refuses_empty_or_nonpositive_counts():
    with pytest.raises(ValueError, match="positive"):
        fastest_threads(lambda: None, [])
    with pytest.raises(ValueError, match="positive"):
        fastest_threads(lambda: None, [0, 1])


def test_explicit_requests_skip_the_probe(monkeypatch):
    def never():
        raise AssertionError("the probe must not run")

    choice = choose_threads(1, never)
    assert choice == ThreadChoice(1, "--threads", load=choice.load) and torch.get_num_threads() == 1
    assert "set by --threads" in choice.header()
    with pytest.raises(ValueError, match="at least 1"):
        choose_threads(0, never)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    choice = choose_threads(None, never)
    assert (choice.threads, choice.how) == (1, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(None, never, device="cuda").how == "torch's default"
    assert choose_threads(None, None).how == "torch's default"


def test_the_probe_runs_over_every_usable_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []

    def build():
        return lambda: seen.append(torch.get_num_threads())

    choice = choose_threads(None, build)
    assert choice.how == "probe" and sorted(choice.medians) == list(range(1, usable_cores() + 1))
    assert set(seen) == set(range(1, usable_cores() + 1)) and torch.get_num_threads() == choice.threads
    record = choice.record()
    assert record["threads"] == choice.threads and set(record["probe_ms"]) == {str(n) for n in choice.medians}
    header = choice.header()
    assert header.startswith(f"torch threads: {choice.threads} of {usable_cores()} cores") and "load average" in header


def test_header_marks_a_stopped_count_as_a_lower_bound():
    choice = ThreadChoice(1, "probe", {1: 0.04, 2: 2.4}, (1.5, 0.5, 0.25), frozenset({2}))
    assert "1: 40 ms, 2: >2400 ms per step" in choice.header() and "1.50 / 0.50 / 0.25" in choice.header()
    assert ThreadChoice(2, "--threads").header().endswith("load average unknown (1 / 5 / 15 min)")


def test_demo_probes_threads_prints_them_with_the_load_and_records_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-m", "geomopt", "demo", "--steps", "3", "--no-progress", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    header = [line for line in out.stdout.splitlines() if line.startswith("torch threads:")]
    assert len(header) == 1 and "the fastest on a probe" in header[0] and "load average" in header[0]
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["thread_choice"]["how"] == "probe" and record["threads"] == record["thread_choice"]["threads"]
    assert set(record["thread_choice"]["probe_ms"]) == {str(n) for n in range(1, usable_cores() + 1)}


def test_demo_takes_threads(tmp_path, capsys):
    from geomopt.cli.main import EXIT_USAGE, main

    assert main(["demo", "--steps", "2", "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "torch threads: 1 of" in capsys.readouterr().out
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["thread_choice"]["how"] == "--threads" and record["command"].endswith("--threads 1")
    assert main(["demo", "--threads", "0", "--out", str(tmp_path)]) == EXIT_USAGE
