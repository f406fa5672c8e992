"""A pytest plugin that delays tba's worker-side transfers at random, to find tests (and code)
that pass only when the workers keep up with the training thread.

    .venv/bin/python -m pytest -p tests.chaos tests/cache tests/offloaders

Every store, reserve and worker load sleeps a random 0 to ``TBA_CHAOS_MAX_MS`` milliseconds
(default 30) first; ``TBA_CHAOS_SIDES`` (default ``store,load,reserve``) picks which. Inline
transfers (Note [Small transfers inline]) run on the training thread and are not delayed. The
delays are seeded (``TBA_CHAOS_SEED``, default 0) but thread scheduling is not, so a run is not
repeatable. A test that fails under it either rests on timing (a bit-exact test that asserts
bytes moved without ``settle=True``: backward cancels the stores that have not run) or found a
real race. Known to rest on timing: ``tests/cache/test_adaptive.py::
test_unthrottled_offloads_every_block_but_the_tail`` (the policy measures real stores).
"""

from __future__ import annotations

import os
import random
import threading
import time

from tba.cache.workers import TransferWorkers

_MAX_S = float(os.environ.get("TBA_CHAOS_MAX_MS", "30")) / 1000
_SIDES = set(os.environ.get("TBA_CHAOS_SIDES", "store,load,reserve").split(","))
_rng = random.Random(int(os.environ.get("TBA_CHAOS_SEED", "0")))
_rng_lock = threading.Lock()


def _delay() -> None:
    with _rng_lock:
        seconds = _rng.random() * _MAX_S
    time.sleep(seconds)


def pytest_configure(config) -> None:
    run_store, run_load, reserve_now = (
        TransferWorkers._run_store, TransferWorkers._run_load, TransferWorkers._reserve_now
    )

    def delayed_store(self, *args, **kwargs):
        if "store" in _SIDES:
            _delay()
        return run_store(self, *args, **kwargs)

    def delayed_load(self, entry, token):
        if "load" in _SIDES and not entry.inline:
            _delay()
        return run_load(self, entry, token)

    def delayed_reserve(self, *args, **kwargs):
        if "reserve" in _SIDES:
            _delay()
        return reserve_now(self, *args, **kwargs)

    TransferWorkers._run_store = delayed_store
    TransferWorkers._run_load = delayed_load
    TransferWorkers._reserve_now = delayed_reserve
