"""A pytest plugin that delays tba's transfers at random, to find tests (and code) that pass
only when the workers keep up with the training thread.

    .venv/bin/python -m pytest -p tests.chaos tests/cache tests/offloaders

Every offloader ``tba.configure_tensor_cache`` builds (or is given) is wrapped in
``tba.testing.ChaosOffloader``: each store, reserve and worker load sleeps a random 0 to
``TBA_CHAOS_MAX_MS`` milliseconds (default 30) first; ``TBA_CHAOS_SIDES`` (default
``store,load,reserve``) picks which. Small CPU storages the cache would store inline (Note
[Small transfers inline]) go to the workers half the time (``TBA_CHAOS_WORKER_FRACTION``, default
0.5); those stored inline are loaded without delay. Each cache's delays are seeded
(``TBA_CHAOS_SEED``, default 0, plus the number of caches made before it) but thread scheduling
is not, so a run is not repeatable. A test that fails under it either rests on timing (a
bit-exact test that asserts bytes moved without ``settle=True``: backward cancels the stores
that have not run), expects the offloader it passed to be the cache's own object, or found a real
race. Known to rest on timing: ``tests/cache/test_adaptive.py::
test_unthrottled_offloads_every_block_but_the_tail`` (the policy measures real stores).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from tba.testing import ChaosOffloader

_MAX_S = float(os.environ.get("TBA_CHAOS_MAX_MS", "30")) / 1000
_SIDES = tuple(os.environ.get("TBA_CHAOS_SIDES", "store,load,reserve").split(","))
_WORKER_FRACTION = float(os.environ.get("TBA_CHAOS_WORKER_FRACTION", "0.5"))
_seeds = itertools.count(int(os.environ.get("TBA_CHAOS_SEED", "0")))


def pytest_configure(config: Any) -> None:
    import tba.offloaders

    make_offloader = tba.offloaders.make_offloader

    def chaotic(cache_config: Any, *, rank: int | None = None) -> Any:
        inner = make_offloader(cache_config, rank=rank)
        if inner is None:
            return None
        return ChaosOffloader(inner, max_delay_s=_MAX_S, seed=next(_seeds), sides=_SIDES,
                              worker_fraction=_WORKER_FRACTION)

    # configure_tensor_cache looks make_offloader up in tba.offloaders at each call.
    tba.offloaders.make_offloader = chaotic
