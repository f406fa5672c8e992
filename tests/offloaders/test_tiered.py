"""The host pool with SSD spill (``offloader="host+ssd"``, ``TieredOffloader``): placement
against the budget (Note [Host budget placement]), per-tier stats, bit-exact round trips from
both tiers, thread safety, cleanup, and the config options."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tba
from tba.offloaders import HostOffloader, TieredOffloader
from tba.offloaders.ssd import SSDOffloader
from tba.offloaders.tier_stats import TierStats
from tests.offloaders.ssd_helpers import typed_tensor

_KiB = 1 << 10


def _tiered(tmp_path: Path, budget: int) -> TieredOffloader:
    return TieredOffloader(budget, spill=SSDOffloader(dirs=str(tmp_path), engine="posix"))


def _bytes(num_bytes: int, seed: int) -> torch.Tensor:
    return typed_tensor(num_bytes, torch.uint8, seed=seed)


def _round_trip(off: TieredOffloader, token, src: torch.Tensor) -> None:
    out = torch.empty_like(src)
    off.load(token, out)
    assert torch.equal(out, src)


def test_round_trips_from_both_tiers_are_bit_exact(tmp_path: Path, device: str) -> None:
    off = _tiered(tmp_path, 8 * _KiB)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.bool):
            srcs = [typed_tensor(n, dtype, device=device, seed=n) for n in (1, 511, 4097, 3 * _KiB, 20 * _KiB)]
            srcs = [s.view(-1).view(torch.uint8) for s in srcs]
            tokens = [off.store(s) for s in srcs]
            assert {t.tier for t in tokens} == {0, 1}, dtype
            for token, src in zip(tokens, srcs):
                _round_trip(off, token, src)
                off.release(token)
        assert off.used_bytes == 0
    finally:
        off.close()


def test_exact_fit_stays_on_host_and_the_rest_spills(tmp_path: Path) -> None:
    off = _tiered(tmp_path, 3 * _KiB)
    try:
        srcs = [_bytes(_KiB, seed=i) for i in range(5)]
        tokens = [off.store(s) for s in srcs]
        # Three fill the budget exactly (held + size <= budget); the fourth and fifth spill.
        assert [t.tier for t in tokens] == [0, 0, 0, 1, 1]
        for token, src in zip(tokens, srcs):
            _round_trip(off, token, src)
        stats = off.tier_stats()
        assert stats["host"] == TierStats(
            num_stored=3, stored_bytes=3 * _KiB, held_bytes=3 * _KiB, peak_held_bytes=3 * _KiB,
            budget_bytes=3 * _KiB, num_over_budget=2,
        )
        assert stats["ssd"] == TierStats(
            num_stored=2, stored_bytes=2 * _KiB, held_bytes=2 * _KiB, peak_held_bytes=2 * _KiB
        )
        # The SSD tier keeps each tensor at its in-page offset (Note [Direct windows]): a KiB
        # takes one 4 KiB page, or two when it crosses a page boundary at that offset.
        spilled_pages = sum(-(-(s.data_ptr() % 4096 + s.numel()) // 4096) for s in srcs[3:])
        assert off.host.used_bytes == 3 * _KiB and off.spill.used_bytes == spilled_pages * 4096
        for token in tokens:
            off.release(token)
        assert off.host.used_bytes == 0 and off.spill.used_bytes == 0 and off.used_bytes == 0
        stats = off.tier_stats()
        assert stats["host"].held_bytes == 0 and stats["ssd"].held_bytes == 0
        assert stats["host"].peak_held_bytes == 3 * _KiB and stats["ssd"].peak_held_bytes == 2 * _KiB
    finally:
        off.close()


def test_a_step_larger_than_the_budget_spills_the_rest_and_released_space_is_reused(tmp_path: Path) -> None:
    off = _tiered(tmp_path, 8 * _KiB)
    try:
        step = [_bytes(3 * _KiB, seed=i) for i in range(5)]  # 15 KiB: two fit, three spill
        tokens = [off.store(s) for s in step]
        assert [t.tier for t in tokens] == [0, 0, 1, 1, 1]
        off.release(tokens[0])  # backward frees one host tensor ...
        again = off.store(_bytes(3 * _KiB, seed=9))
        assert again.tier == 0  # ... and the next store takes its place before anything spills
        assert off.tier_stats()["host"].held_bytes == 6 * _KiB
        taken = off.take_tier_stats()
        assert taken["host"].num_stored == 3 and taken["ssd"].num_stored == 3
        assert taken["ssd"].stored_bytes == 9 * _KiB and taken["host"].num_over_budget == 3
        for src, token in zip(step[1:], tokens[1:]):
            _round_trip(off, token, src)
        for token in (*tokens[1:], again):
            off.release(token)
        # A new interval starts from what is held now and counts only what happens in it.
        interval = off.take_tier_stats()
        assert interval["host"] == TierStats(peak_held_bytes=6 * _KiB, budget_bytes=8 * _KiB)
        assert interval["ssd"] == TierStats(peak_held_bytes=9 * _KiB)
        assert off.take_tier_stats()["ssd"].peak_held_bytes == 0
        total = off.tier_stats()
        assert total["host"].num_stored == 3 and total["host"].peak_held_bytes == 6 * _KiB
    finally:
        off.close()


def test_no_contiguous_room_within_the_budget_spills_and_is_counted_apart(tmp_path: Path) -> None:
    off = _tiered(tmp_path, 4 * _KiB)  # the host pool is capped at 4 KiB too
    try:
        a, b, c = (off.store(_bytes(_KiB, seed=i)) for i in range(3))
        off.release(b)  # a 1 KiB hole between a and c; 1 KiB free at the end
        big = _bytes(2 * _KiB, seed=7)
        token = off.store(big)  # 2 KiB + 2 KiB held fits the budget, but no 2 KiB extent is free
        assert token.tier == 1
        _round_trip(off, token, big)
        host = off.tier_stats()["host"]
        assert (host.num_no_room, host.num_over_budget, host.held_bytes) == (1, 0, 2 * _KiB)
        assert off.host.capacity_bytes == 4 * _KiB  # the pool did not grow past the budget
        for t in (a, c, token):
            off.release(t)
    finally:
        off.close()


def test_release_is_idempotent_and_a_released_token_cannot_be_loaded(tmp_path: Path) -> None:
    off = _tiered(tmp_path, _KiB)
    try:
        for size in (_KiB, 2 * _KiB):  # one per tier
            token = off.store(_bytes(size, seed=size))
            off.release(token)
            off.release(token)
            with pytest.raises(ValueError, match="released token"):
                off.load(token, torch.empty(size, dtype=torch.uint8))
        stats = off.tier_stats()
        assert stats["host"].held_bytes == 0 and stats["ssd"].held_bytes == 0 and off.used_bytes == 0
    finally:
        off.close()


def test_reserve_sizes_the_host_pool_up_to_the_budget_and_the_ssd_for_the_rest(tmp_path: Path) -> None:
    budget = 1 << 20
    for name, reserved, host_bytes, ssd_bytes in (("over", 5 << 20, budget, 4 << 20), ("under", budget // 2, budget // 2, 0)):
        (tmp_path / name).mkdir()
        off = _tiered(tmp_path / name, budget)
        try:
            off.reserve(reserved)
            off.store(_bytes(_KiB, seed=0))  # the host pool applies a reservation at its next store
            assert off.host.capacity_bytes == host_bytes, name
            assert off.spill.capacity_bytes == ssd_bytes, name  # SSD slabs grow by exactly what is missing
        finally:
            off.close()


def test_close_removes_the_spill_files_and_is_idempotent(tmp_path: Path) -> None:
    off = _tiered(tmp_path, _KiB)
    token = off.store(_bytes(3 * _KiB, seed=1))
    assert token.tier == 1 and list(tmp_path.iterdir())
    off.close()
    off.close()
    assert list(tmp_path.iterdir()) == []
    assert off.host.capacity_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        off.store(_bytes(1, seed=0))
    off.release(token)  # a no-op after close


def test_concurrent_stores_never_take_the_host_tier_past_its_budget(tmp_path: Path) -> None:
    budget = 48 * _KiB
    off = _tiered(tmp_path, budget)
    errors: list[BaseException] = []
    tiers_seen: set[int] = set()

    def worker(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            held = []
            for i in range(40):
                src = _bytes(int(torch.randint(1, 12 * _KiB, (1,), generator=gen)), seed=seed * 100 + i)
                held.append((off.store(src), src))
                if len(held) > 3:
                    token, kept = held.pop(0)
                    _round_trip(off, token, kept)
                    tiers_seen.add(token.tier)
                    off.release(token)
            for token, kept in held:
                _round_trip(off, token, kept)
                off.release(token)
        except BaseException as e:  # reported on the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads), "workers still running after 120 s"
        assert not errors, errors
        stats = off.tier_stats()
        assert stats["host"].num_stored + stats["ssd"].num_stored == 160
        assert stats["host"].peak_held_bytes <= budget and tiers_seen == {0, 1}
        assert stats["host"].held_bytes == 0 and stats["ssd"].held_bytes == 0 and off.used_bytes == 0
    finally:
        off.close()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        TieredOffloader(0, spill=object())  # type: ignore[arg-type]
    assert "host_budget_bytes=0" in str(info.value) and "spill=" in str(info.value)
    with pytest.raises(ValueError, match="another kind"):
        TieredOffloader(1, spill=HostOffloader())


# --- config -----------------------------------------------------------------------------------


def test_config_needs_a_budget_for_host_ssd_and_only_there() -> None:
    with pytest.raises(ValueError, match="needs host_budget_bytes"):
        tba.TensorCacheConfig(offloader="host+ssd")
    for offloader in ("host", "ssd", "none"):
        with pytest.raises(ValueError, match="used only by offloader='host\\+ssd'"):
            tba.TensorCacheConfig(offloader=offloader, host_budget_bytes=1 << 30)
    assert tba.TensorCacheConfig(offloader="host+ssd", host_budget_bytes=1 << 30).host_budget_bytes == 1 << 30


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_config_rejects_bad_budgets_with_every_problem_at_once(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        tba.TensorCacheConfig(offloader="host+ssd", host_budget_bytes=bad, num_store_threads=0)
    message = str(info.value)
    assert f"host_budget_bytes={bad!r}: expected None or a positive integer" in message
    assert "num_store_threads=0" in message


def test_placement_line_example_runs() -> None:
    import doctest

    import tba.cache.observe.stats

    result = doctest.testmod(tba.cache.observe.stats, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
