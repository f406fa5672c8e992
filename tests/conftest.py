"""Shared fixtures: the ``device`` parametrisation and the GPU-skip policy."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from tba import _env

# Note [Cache invariants]: every cache made by any test (and by the workers tests start, which
# inherit the environment) checks its bookkeeping after each completed step and raises
# TBAError in the training step on a violation.
os.environ.setdefault("TBA_CHECK_INVARIANTS", "1")

# Note [One intra-op thread in the suite]: torch's CPU kernels default to one OpenMP thread per
# core, and tba's store and load workers run beside them, so on the 2-core machines the suite runs
# on, a training step had more runnable threads than cores, and OpenMP's threads spin while they
# wait for each other. tests/cache/test_transformers.py and test_closed_loop.py took 49.6 s of CPU
# (100 s wall, load average 9) with two threads and 5.2 s (10 s wall) with one. The tests compare
# tba with plain PyTorch in the same process, so both run with the same thread count; tba's code
# does not depend on it. Child processes (benchmark smoke runs, workers) keep torch's default.
# OMP_NUM_THREADS, when set, wins (a run with more threads: OMP_NUM_THREADS=2 pytest ...).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# Note [Suites started in the background]: a shell without job control starts a background
# command (`pytest ... &`) with SIGINT ignored, and its children inherit that. tba leaves an
# ignored SIGINT alone (the script chose it), so the tests of tba's Ctrl-C handling, and the
# child processes that check what `import tba` installs, would see a process no user's
# training script runs in. Put Python's default handler back for the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _devices() -> list:
    params = [pytest.param("cpu", id="cpu")]
    params.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
    return params


@pytest.fixture(params=_devices())
def device(request) -> str:
    """Runs a test body once on CPU and once on CUDA (skipped, or failed under
    ``TBA_REQUIRE_GPU=1``, when no GPU is present)."""
    if request.param == "cuda":
        require_cuda()
    return request.param


def require_cuda() -> None:
    """Skip the calling test without CUDA; fail instead when ``TBA_REQUIRE_GPU=1``."""
    if not _cuda_available():
        if _env.require_gpu():
            pytest.fail("TBA_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
        pytest.skip("needs a CUDA device")


# Note [The suite's imports are frozen]: collecting the suite imports torch, transformers, the
# pipeline engines and every test module: some 380k objects that live as long as the session.
# Every full collection of the garbage collector walks all of them (~0.2 s each on 2 cores), and
# the suite's tests, building models and graphs, trigger hundreds: later tests paid for the
# imports of all earlier ones. Frozen after collection (gc.freeze: moved to the permanent
# generation) they are never walked again; the suite's garbage collection CPU time halved
# (docs/building.md). Collected first, so no garbage is frozen: nothing a test leaves is frozen,
# and tests that need a collection still get it.
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "gpu" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
        require_cuda()
