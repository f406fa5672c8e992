"""``ChaosOffloader``: which calls it delays and how, and parity under it; the pytest plugin
``tests.chaos`` that wraps every cache's offloader in it."""

from __future__ import annotations

import pytest
import torch

import tba
import tba.offloaders
from tba.offloaders import HostOffloader, Offloader
from tba.testing import ChaosOffloader, FakeOffloader, check_parity
from tests.testing import factories


def chaos(inner: Offloader, **kwargs) -> tuple[ChaosOffloader, list[float]]:
    delays: list[float] = []
    return ChaosOffloader(inner, sleep=delays.append, **kwargs), delays


def test_store_load_and_reserve_are_delayed_within_the_bound() -> None:
    offloader, delays = chaos(FakeOffloader(), max_delay_s=0.02, seed=3)
    assert isinstance(offloader, Offloader) and offloader.name == "chaos(fake)"
    token = offloader.store(torch.arange(10, dtype=torch.uint8))
    dst = torch.empty(10, dtype=torch.uint8)
    offloader.load(token, dst)
    offloader.reserve(100)
    assert torch.equal(dst, torch.arange(10, dtype=torch.uint8))
    assert len(delays) == 3 and all(0 <= d <= 0.02 for d in delays) and len(set(delays)) == 3
    assert offloader.num_delays == 3 and offloader.delayed_s == pytest.approx(sum(delays))
    assert offloader.inner.reserved == [100]
    again, same = chaos(FakeOffloader(), max_delay_s=0.02, seed=3)
    again.store(torch.zeros(1, dtype=torch.uint8))
    assert same == delays[:1]  # seeded


def test_sides_pick_what_is_delayed() -> None:
    offloader, delays = chaos(FakeOffloader(), sides=("load",))
    token = offloader.store(torch.zeros(4, dtype=torch.uint8))
    offloader.reserve(4)
    assert delays == []
    offloader.load(token, torch.empty(4, dtype=torch.uint8))
    assert len(delays) == 1


def test_inline_stores_go_to_the_workers_at_random() -> None:
    assert not hasattr(chaos(FakeOffloader())[0], "store_now")  # the inner one has none
    inner = HostOffloader()
    inner.release(inner.store(torch.zeros(1 << 12, dtype=torch.uint8)))  # a pool to store into
    storage = torch.arange(64, dtype=torch.uint8).untyped_storage()
    always, delays = chaos(inner, worker_fraction=1.0)
    assert always.store_now(storage) is None
    never, delays = chaos(inner, worker_fraction=0.0)
    token = never.store_now(storage)
    assert token is not None
    dst = torch.empty(64, dtype=torch.uint8)
    never.load(token, dst)  # an inline token loads on the unpacking thread: no delay
    never.release(token)
    assert delays == [] and torch.equal(dst, torch.arange(64, dtype=torch.uint8))
    half, _ = chaos(inner, worker_fraction=0.5, seed=0)
    answers = [half.store_now(storage) for _ in range(40)]
    assert 5 < sum(a is None for a in answers) < 35
    for answer in answers:
        if answer is not None:
            half.release(answer)
    inner.close()


def test_bad_arguments_are_listed_at_once() -> None:
    with pytest.raises(ValueError) as info:
        ChaosOffloader(FakeOffloader(), max_delay_s=-1, sides=("write",), worker_fraction=2)
    message = str(info.value)
    assert message.startswith("invalid tba.testing.ChaosOffloader:")
    assert all(name in message for name in ("max_delay_s=-1", "sides=('write',)", "worker_fraction=2"))


@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_gpt2_parity_under_chaos(offloader: str, tmp_path) -> None:
    pytest.importorskip("transformers")
    options = {"ssd_dirs": (str(tmp_path),), "ssd_engine": "posix"} if offloader == "ssd" else {}
    report = check_parity(factories.gpt2(), factories.lm_batches(3), offloader=offloader, force=True,
                          chaos=True, chaos_max_delay_s=0.002, **options)
    assert report.ok, str(report)
    assert report.offloader == offloader


def test_check_parity_with_chaos_wraps_the_offloader(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[ChaosOffloader] = []
    real_init = ChaosOffloader.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ChaosOffloader, "__init__", init)
    report = check_parity(factories.stack(), factories.vector_batches(2), force=True, chaos=True,
                          chaos_max_delay_s=0.001, seed=5)
    assert report.ok, str(report)
    assert len(made) == 1 and made[0].max_delay_s == 0.001 and made[0].num_delays > 0


def test_the_pytest_plugin_wraps_what_configure_tensor_cache_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.chaos

    monkeypatch.setattr(tba.offloaders, "make_offloader", tba.offloaders.make_offloader)  # restored after
    tests.chaos.pytest_configure(None)
    model = factories.stack()
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",)) as cache:
        assert isinstance(cache.offloader, ChaosOffloader) and isinstance(cache.offloader.inner, HostOffloader)
        assert cache.offloader.name == "host"  # as without the plugin
        assert cache.offloader.capacity_bytes == cache.offloader.inner.capacity_bytes  # seen through
    with tba.configure_tensor_cache(model, offloader="none", offload_devices=("cpu",)) as cache:
        assert cache.offloader is None
