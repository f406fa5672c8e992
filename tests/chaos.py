"""A pytest plugin that delays tba's transfers at random, to find tests (and code) that pass
only when the workers keep up with the training thread.

    .venv/bin/python -m pytest -p tests.chaos tests/cache tests/offloaders

Every offloader ``tba.configure_tensor_cache`` builds (or is given) is wrapped in
``tba.testing.ChaosOffloader``: each store, reserve and worker load sleeps a random 0 to
``TBA_CHAOS_MAX_MS`` milliseconds (default 30) first; ``TBA_CHAOS_SIDES`` (default
``store,load,reserve``) picks which. Small CPU storages the cache stores inline (Note [Small
transfers inline]) stay inline and are not delayed, unless ``TBA_CHAOS_WORKER_FRACTION`` (default
0) sends that fraction of them to the workers (where the adaptive policy's measured write
bandwidth then includes the delays). Each cache's delays are seeded
(``TBA_CHAOS_SEED``, default 0, plus the number of caches made before it) but thread scheduling
is not, so a run is not repeatable. Attributes the wrapper does not have are read from the
wrapped offloader, so tests that inspect ``cache.offloader`` run unchanged. A test that fails
under it either rests on timing (a bit-exact test that asserts bytes moved without
``settle=True``: backward cancels the stores that have not run), expects the offloader it passed
to be the cache's own object, or found a real race (docs/testing.md, "Tests under load").
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from tba.testing import ChaosOffloader

_MAX_S = float(os.environ.get("TBA_CHAOS_MAX_MS", "30")) / 1000
_SIDES = tuple(os.environ.get("TBA_CHAOS_SIDES", "store,load,reserve").split(","))
_WORKER_FRACTION = float(os.environ.get("TBA_CHAOS_WORKER_FRACTION", "0"))
_seeds = itertools.count(int(os.environ.get("TBA_CHAOS_SEED", "0")))


class _SeeThroughChaos(ChaosOffloader):
    """A chaos wrapper that lends the tests every other attribute of the offloader it wraps
    (``cache.offloader.tier_stats()``, ``.directories``), so tests that inspect their offloader
    run under the plugin unchanged, and its name."""

    def __init__(self, inner: Any, **kwargs: Any) -> None:
        super().__init__(inner, **kwargs)
        self.name = inner.name  # messages and tests see the offloader's own name

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def pytest_configure(config: Any) -> None:
    import tba.offloaders

    make_offloader = tba.offloaders.make_offloader

    def chaotic(cache_config: Any, *, rank: int | None = None) -> Any:
        inner = make_offloader(cache_config, rank=rank)
        if inner is None:
            return None
        return _SeeThroughChaos(inner, max_delay_s=_MAX_S, seed=next(_seeds), sides=_SIDES,
                              worker_fraction=_WORKER_FRACTION)

    # configure_tensor_cache looks make_offloader up in tba.offloaders at each call.
    tba.offloaders.make_offloader = chaotic
