"""Settings for the whole test session.

One torch thread, here and in every subprocess a test starts (the examples, the benchmark scripts,
torchrun ranks inherit the environment), unless OMP_NUM_THREADS is already set. The suite's tensors
are tiny, so a second intra-op thread buys nothing; on a 2-core CPU that is also running anything
else, every parallel region waits until both threads get a core. Measured on such a machine (2
cores, AVX2, other jobs running): the four Scion equivalence tests 0.2 s each at 1 thread against
6–9 s at 2, benchmarks/svd_free.py's test 0.2 s against 20 s, the whole suite 3 min 51 s against
5 min 58 s run back to back (and up to 13 min at 2 threads under heavier load).
``OMP_NUM_THREADS=2 python -m pytest`` runs it with two.

The README's command runs the suite in two pytest-xdist workers (``-n 2``: one process a core;
``-n 0`` runs it in this process), scheduled by ``--dist loadgroup`` (pyproject.toml): a test runs
on whichever worker is free, except those marked ``xdist_group("torchrun")``, which start gloo
processes under torchrun (2 to 8 ranks each, module fixtures shared by many tests). One worker runs
all of them, one launch after another, so that a module's launch runs once, and two launches (8
ranks beside 4) never share the two cores; the other worker runs the rest meanwhile.
"""

from __future__ import annotations

import os

_threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", _threads)

import torch  # noqa: E402  (after the environment, so that this process starts with it too)

if _threads.isdigit() and int(_threads) > 0:
    torch.set_num_threads(int(_threads))


import pytest  # noqa: E402


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype for a test (modules whose references are float64 use it
    with ``pytestmark = pytest.mark.usefixtures("float64_default")``)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
