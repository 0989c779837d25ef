"""How many torch CPU threads a training run uses: measured on the run's own step, not guessed.

Torch's intra-op threads (OpenMP) spin while they wait for each other. On a machine whose cores are
also running other work, a parallel region waits until every one of its threads gets a core, so a
small model can run several times slower on two threads than on one (the demo's GPT, width 64, on a
2-core machine with one other busy process: 39.7 s at 2 threads against 7.1 s at 1). Whether a
second thread pays depends on the model's size, the machine and its load at the time, so the count
is chosen by a short probe of the run's own training step (:func:`fastest_threads`): every count
from 1 to the number of cores, a few timed steps each, the fewest threads whose median step is
within ``TOLERANCE`` of the fastest. A count that is already far behind stops early, so a probe
under load costs little more than a probe of the winner.

``--threads N`` (:func:`add_threads_arg`) or ``OMP_NUM_THREADS`` in the environment skips the
probe; CUDA runs do not probe (the CPU only feeds the device)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TOLERANCE = 0.10  # a count with more threads must be more than 10% faster to be chosen
WARMUP = 2  # untimed steps at each count (the thread pool grows, caches fill)
TIMED = 5  # timed steps at each count; the median is compared
GIVE_UP = 3.0  # stop timing a count once its steps so far took this many times the best count's


@dataclass(frozen=True)
class ThreadChoice:
    """The chosen thread count, how it was chosen (``"probe"`` or ``"--threads"``), the median step
    per probed count (seconds), the counts ``stopped`` early (their figure is a lower bound: the
    median of the timed steps they ran, or all their time where they ran none) and the machine's
    load averages (1, 5, 15 min) when it was chosen (None where the platform has none)."""

    threads: int
    how: str
    medians: dict[int, float] = field(default_factory=dict)
    load: tuple[float, float, float] | None = None
    stopped: frozenset[int] = frozenset()

    def header(self) -> str:
        """One line for a run's header: the count, why, and the load."""
        cores = usable_cores()
        if self.medians:
            probe = ", ".join(f"{n}: {'>' if n in self.stopped else ''}{1e3 * s:.0f} ms"
                              for n, s in sorted(self.medians.items()))
            why = f"the fastest on a probe of this run's step ({probe} per step)"
        else:
            why = f"set by {self.how}"
        load = "unknown" if self.load is None else " / ".join(f"{x:.2f}" for x in self.load)
        return f"torch threads: {self.threads} of {cores} cores, {why}; load average {load} (1 / 5 / 15 min)"

    def record(self) -> dict:
        """The choice as a JSON-able dict, for a run's results record."""
        return dict(threads=self.threads, how=self.how, load=list(self.load) if self.load else None,
                    probe_ms={str(n): round(1e3 * s, 2) for n, s in sorted(self.medians.items())},
                    stopped=sorted(self.stopped))


def machine_load() -> tuple[float, float, float] | None:
    """The load averages over 1, 5 and 15 minutes, or None where the platform has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return one, five, fifteen


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform tells), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fastest_threads(step: Callable[[], object], counts: list[int], *, warmup: int = WARMUP, timed: int = TIMED,
                    tolerance: float = TOLERANCE, give_up: float = GIVE_UP,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[int, dict[int, float], frozenset[int]]:
    """Run ``step()`` ``warmup`` + ``timed`` times at each thread count of ``counts`` (in order) and
    return (the fewest threads whose median timed step is within ``tolerance`` of the fastest median,
    the medians by count, the counts stopped early). A count whose steps so far (warm-up included)
    take more than ``give_up`` times the best finished count's is stopped there: its figure (the
    median of its timed steps, or all its time where it ran none) is a lower bound, and it is not
    chosen. Torch's thread count is left at the choice."""
    import torch  # torch: off the lint path

    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"thread counts must be positive, got {counts}")
    medians: dict[int, float] = {}
    stopped: set[int] = set()
    best_total = float("inf")
    for n in counts:
        torch.set_num_threads(n)
        times: list[float] = []
        spent = 0.0
        for k in range(warmup + timed):
            t0 = clock()
            step()
            dt = clock() - t0
            spent += dt
            if k >= warmup:
                times.append(dt)
            if spent > give_up * best_total:
                break
        medians[n] = statistics.median(times) if times else spent
        if len(times) == timed:
            best_total = min(best_total, spent)
        else:
            stopped.add(n)
    finished = {n: s for n, s in medians.items() if n not in stopped}
    fastest = min(finished.values())
    chosen = min(n for n, s in finished.items() if s <= (1 + tolerance) * fastest)
    torch.set_num_threads(chosen)
    return chosen, medians, frozenset(stopped)


def choose_threads(requested: int | None, probe: Callable[[], Callable[[], object]] | None,
                   device: str = "cpu") -> ThreadChoice:
    """Set torch's thread count for a training run and say how it was chosen: ``requested`` where
    given (``--threads``), else ``OMP_NUM_THREADS`` where the environment sets it, else the probe
    over 1…(the cores this process may use) of the step ``probe()`` builds, on the CPU (on a CUDA
    device, or without a probe, torch's own count)."""
    import torch  # torch: off the lint path

    load = machine_load()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        torch.set_num_threads(requested)
        return ThreadChoice(requested, "--threads", load=load)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:  # the user's own setting, as torch itself reads it
        torch.set_num_threads(int(env))
        return ThreadChoice(int(env), "OMP_NUM_THREADS", load=load)
    if probe is None or not str(device).startswith("cpu"):
        return ThreadChoice(torch.get_num_threads(), "torch's default", load=load)
    chosen, medians, stopped = fastest_threads(probe(), list(range(1, usable_cores() + 1)))
    return ThreadChoice(chosen, "probe", medians, load, stopped)


def training_step(model, opt, loss: Callable[[object], object]) -> Callable[[], None]:
    """One training step of ``model`` with ``opt`` as a function (zero the gradients, backward of
    ``loss(model)``, ``opt.step()``): what the probe times."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model).backward()  # type: ignore[attr-defined]
        opt.step()

    return step


def add_threads_arg(parser) -> None:
    """``--threads N``: the torch CPU threads of a run (default: the fastest on a short probe)."""
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch CPU threads (default: the fastest of 1…cores on a short probe of the run's "
                             "own training step, printed with the machine's load)")
