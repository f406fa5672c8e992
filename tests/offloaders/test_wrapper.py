"""One forwarding base for offloaders that wrap another (issue 30): `tba.offloaders.Throttled`
and tba.testing's wrappers pass the protocol's optional parts through alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tba
from tba.offloaders import HostOffloader, Offloader, OffloaderWrapper, Throttled, TieredOffloader
from tba.offloaders.ssd import SSDOffloader
from tba.testing import ChaosOffloader
from tests import models

WRAPPERS: dict[str, Callable[[Offloader], OffloaderWrapper]] = {
    "base": lambda inner: OffloaderWrapper(inner, "label"),
    "throttled": lambda inner: Throttled(inner, write_bytes_per_s=1e12),
    "chaos": lambda inner: ChaosOffloader(inner, max_delay_s=0.0),
}


@pytest.mark.parametrize("kind", WRAPPERS)
def test_wrappers_pass_the_optional_parts_through(kind: str, tmp_path: Path) -> None:
    tiered = TieredOffloader(1 << 20, spill=SSDOffloader(dirs=(str(tmp_path),), engine="posix"))
    wrapped = WRAPPERS[kind](tiered)
    assert isinstance(wrapped, Offloader) and wrapped.inner is tiered
    assert wrapped.name.endswith(f"({tiered.name})"), wrapped.name
    token = wrapped.store(torch.ones(1000, dtype=torch.uint8))
    assert wrapped.used_bytes == tiered.used_bytes > 0
    assert set(wrapped.take_tier_stats()) == set(tiered.tier_names)
    dst = torch.empty(1000, dtype=torch.uint8)
    wrapped.load(token, dst)
    assert torch.equal(dst, torch.ones(1000, dtype=torch.uint8))
    wrapped.release(token)
    assert wrapped.used_bytes == 0
    wrapped.close()


def test_throttled_stores_are_never_inline() -> None:
    # The host offloader stores inline when it can (store_now); a throttled store must be
    # paced, so on the store worker: Throttled does not pass store_now through.
    assert getattr(OffloaderWrapper(HostOffloader(), "x"), "store_now", None) is not None
    assert getattr(Throttled("host"), "store_now", None) is None
    assert Throttled("host").name == "throttled(host)"


@pytest.mark.parametrize("offloader", ["nvme", object()])
def test_throttled_refuses_what_is_not_an_offloader_with_every_problem(offloader: object) -> None:
    with pytest.raises(ValueError) as refused:
        Throttled(offloader, read_bytes_per_s=0)  # type: ignore[arg-type]
    message = str(refused.value)
    assert "invalid tba.offloaders.Throttled" in message
    assert "expected 'host', 'ssd' or an Offloader" in message and "read_bytes_per_s=0" in message


def test_a_throttled_pool_is_checked_after_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [Cache invariants]: with used_bytes passed through, the cache sees what the inner
    # pool holds (0 once every entry is gone).
    monkeypatch.setenv("TBA_CHECK_INVARIANTS", "1")
    model = models.Stack(num_blocks=2, width=16)
    slow = Throttled("host", write_bytes_per_s=1e12)
    with tba.configure_tensor_cache(model, offloader=slow, offload_devices=("cpu",),
                                    min_offload_bytes=0, keep_last_modules=0, adaptive=False
                                    ) as cache:
        loss = model(models.vector_batch(0))
        cache.wait_for_stores(60)  # the stores run before backward could cancel them
        loss.backward()
        assert cache.stats().offloaded_bytes > 0
        leaked = slow.inner.store(torch.ones(64, dtype=torch.uint8))  # held by no entry
        held = slow.used_bytes
        assert held is not None and held > 0
        loss = model(models.vector_batch(1))
        # A store still running at the step's end keeps its entry holding offloaded data, and
        # the check then rightly finds nothing to say: the step's stores end before backward.
        cache.wait_for_stores(60)
        with pytest.raises(tba.TBAError, match=f"'throttled\\(host\\)' offloader still holds {held} bytes"):
            loss.backward()
        slow.inner.release(leaked)

