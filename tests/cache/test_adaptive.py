"""Adaptive offloading: the boundary solver on synthetic profiles, the cache's decision on
fast and throttled offloaders, bit-exactness, summary and trace."""

from __future__ import annotations

import json

import pytest
import torch

import tba
from tba.cache.policy.boundary import Boundary, solve_boundary
from tba.offloaders import Throttled
from tba.testing import FakeStepClock, drive_closed_loop
from tests import models
from tests.twin import assert_bytes_moved, run_twins

MiB = 2**20


# ---------------------------------------------------------------- solver, hand-computed
def test_everything_fits() -> None:
    # B = 100 MiB/s, T_f = 1 s, 4 blocks of 0.25 s and 10 MiB:
    # n=0: 20/3 = 6.7; n=1: 30/2.5 = 12; n=2: 40/2 = 20; n=3: 50/1.5 = 33.3 MiB/s, all <= 100.
    n, reason = solve_boundary([0.25] * 4, [10 * MiB] * 4, 1.0, 100 * MiB)
    assert n == 4 and "fit" in reason


def test_boundary_in_the_middle() -> None:
    # B = 25 MiB/s with the profile above: n=2 needs 20 <= 25, n=3 needs 33.3 > 25 -> keep 3.
    assert solve_boundary([0.25] * 4, [10 * MiB] * 4, 1.0, 25 * MiB)[0] == 3
    # B = 10 MiB/s: n=0 6.7 ok, n=1 12 > 10 -> offload only block 0.
    assert solve_boundary([0.25] * 4, [10 * MiB] * 4, 1.0, 10 * MiB)[0] == 1


def test_nothing_fits() -> None:
    # The first block alone needs 2 * 30 MiB / 3 s = 20 MiB/s > 5 MiB/s.
    n, reason = solve_boundary([1.0], [30 * MiB], 1.0, 5 * MiB)
    assert n == 0 and "block 0" in reason


def test_single_block_fits() -> None:
    assert solve_boundary([1.0], [30 * MiB], 1.0, 20 * MiB)[0] == 1


def test_zero_volume_blocks_cost_nothing() -> None:
    # Zero-volume blocks add time, not bytes: 2*12 / (3*1 - 0) = 8; then (0+24)/(3-2*0.5)=12
    n = solve_boundary([0.5, 0.5, 0.0], [0, 12 * MiB, 0], 1.0, 10 * MiB)[0]
    assert n == 1


def test_no_bandwidth_keeps_everything() -> None:
    assert solve_boundary([0.1], [MiB], 1.0, 0.0)[0] == 0
    with pytest.raises(ValueError):
        solve_boundary([0.1, 0.2], [MiB], 1.0, 1.0)


def test_boundary_never_passes_the_kept_tail() -> None:
    b = Boundary(num_blocks=4, keep_last_modules=1)
    b.decide([0.25] * 4, [MiB] * 4, 1.0, 1e12)
    assert b.tail_start == 3
    assert b.decision is not None and b.decision.num_blocks == 4


# ---------------------------------------------------------------- the cache's decisions
@pytest.mark.timing
def test_unthrottled_offloads_every_block_but_the_tail() -> None:
    # The rule weighs the write bandwidth of completed stores against the forward's compute.
    # Both are made certain: every store completes before backward (the profiled step measures
    # its stores however busy the machine is, instead of backward cancelling them), and each
    # block computes for 1 s of a fake clock, so any working host copy is fast enough by orders
    # of magnitude (a real forward of milliseconds on a loaded machine may not hide a store
    # slowed by the load).
    model = models.Stack(num_blocks=6, width=128)
    clock = FakeStepClock()
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=True, profile_step=2) as cache:
        drive_closed_loop(cache, clock=clock)
        for block in model.blocks:  # after tba's hooks: inside the span the profile times
            block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
        for _ in range(4):
            loss = model(torch.randn(256, 16))
            cache.wait_for_stores(60)
            loss.backward()
        decision = cache.adaptive_decision
    assert decision is not None
    assert decision.tail_start == 5, decision
    assert decision.write_bytes_per_s > 0 and decision.forward_s > 0
    assert sum(decision.block_bytes) > 0 and all(t > 0 for t in decision.block_s)


def test_throttled_moves_boundary_earlier() -> None:
    # Writes at 2 MiB/s cannot hide ~1.5 MiB per block behind a forward of milliseconds: the
    # rule keeps every block unless the machine is ~40x slower than this one.
    def run(adaptive: bool) -> tuple[int, tba.TensorCache]:
        torch.manual_seed(0)
        model = models.Stack(num_blocks=6, width=256)
        slow = Throttled("host", write_bytes_per_s=2 * MiB)
        with tba.configure_tensor_cache(model, offloader=slow, offload_devices=("cpu",),
                                        min_offload_bytes=0, adaptive=adaptive) as cache:
            # A store takes ~0.1 s here, longer than a step: the profile completes (and the
            # decision is taken) at the first step that sees a store finish. The slower the
            # machine, the fewer steps that takes (the throttle sleeps in real time): bounded
            # by steps, not by time.
            steps = 0
            while steps < 5 or (adaptive and cache.adaptive_decision is None):
                assert steps < 1000, cache.summary()
                model(torch.randn(256, 16)).backward()
                steps += 1
            return cache.boundary.tail_start, cache

    fixed_tail, _ = run(False)
    adaptive_tail, cache = run(True)
    assert fixed_tail == 5
    assert adaptive_tail < fixed_tail
    decision = cache.adaptive_decision
    assert decision is not None and decision.tail_start == adaptive_tail
    # Bandwidth comes from completed stores, so it is at most the throttle's, not the (far
    # higher) enqueue rate; how far below depends on the machine's load, so only > 0.
    assert 0 < decision.write_bytes_per_s <= 1.05 * 2 * MiB
    assert f"block {adaptive_tail}" in decision.reason


@pytest.mark.parametrize("throttle", [None, 20 * MiB])
def test_adaptive_bit_exact(throttle) -> None:
    offloader = Throttled("host", write_bytes_per_s=throttle) if throttle else "host"
    cache = run_twins(lambda: models.Stack(num_blocks=4, width=64), models.vector_batch, steps=4,
                      settle=True, offloader=offloader, offload_devices=("cpu",),
                      min_offload_bytes=0, adaptive=True, profile_step=2)
    assert_bytes_moved(cache)


def test_reprofiles_when_inputs_change() -> None:
    model = models.Stack(num_blocks=3)
    steady = Throttled("host", write_bytes_per_s=50 * MiB)  # a stable measured bandwidth

    def step(cache, batch: int) -> None:
        loss = model(torch.randn(batch, 16))
        cache.wait_for_stores(60)  # the profile needs completed writes
        loss.backward()

    with tba.configure_tensor_cache(model, offloader=steady, offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=True, profile_step=1) as cache:
        step(cache, 8)
        first = cache.adaptive_decision
        assert first is not None
        step(cache, 8)
        assert first.profiled_at_step == 1
        assert cache.adaptive_decision.profiled_at_step == 1  # the closed loop measures on
        step(cache, 32)  # new shape: this step is profiled again
        step(cache, 32)
        assert cache.adaptive_decision.profiled_at_step == 3


class FakeClock:
    """Stands in for the ``time`` module of the throttle: time moves only when it sleeps
    (or, with ``frozen``, not at all: calls that start at one instant, as from two threads)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.frozen = False
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if not self.frozen:
            self.now += seconds


def test_throttled_caps_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    import tba.offloaders.throttled as throttled

    clock = FakeClock()
    monkeypatch.setattr(throttled, "time", clock)
    slow = Throttled("host", write_bytes_per_s=50 * MiB, read_bytes_per_s=100 * MiB)
    src = torch.arange(5 * MiB, dtype=torch.int64).to(torch.uint8)
    token = slow.store(src)
    assert clock.sleeps == [pytest.approx(0.1)]  # 5 MiB at 50 MiB/s
    dst = torch.empty_like(src)
    slow.load(token, dst)
    assert clock.sleeps[1:] == [pytest.approx(0.05)]  # 5 MiB at 100 MiB/s
    assert torch.equal(dst, src)
    clock.now += 10.0  # idle time is not credited: the next read waits its full share
    slow.load(token, dst)
    assert clock.sleeps[2:] == [pytest.approx(0.05)]
    # Two stores starting at one instant share the cap: the second waits for both slots.
    clock.frozen = True
    first, second = slow.store(src[:MiB]), slow.store(src[:MiB])
    assert clock.sleeps[3:] == [pytest.approx(0.02), pytest.approx(0.04)]
    for t in (token, first, second):
        slow.release(t)
    slow.close()
    with pytest.raises(ValueError, match="write_bytes_per_s=-1"):
        Throttled("host", write_bytes_per_s=-1)


# ---------------------------------------------------------------- summary and trace
@pytest.mark.timing
def test_summary_and_trace(tmp_path) -> None:
    model = models.Stack(num_blocks=4)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, keep_last_modules=1,
                                    adaptive=False) as cache:
        for _ in range(2):
            loss = model(torch.randn(16, 16))
            cache.wait_for_stores(60)
            loss.backward()
        stats = cache.stats()
        table = cache.summary()
        path = tmp_path / "trace.json"
        count = cache.export_trace(str(path))
    assert "offloaded MiB" in table and "0-2 of 4" in table
    assert len(table.splitlines()) == 4
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert count == len(events)
    stores = [e for e in events if e["name"] == "store"]
    loads = [e for e in events if e["name"] == "load"]
    # Small CPU stores are made in batches (Note [Small transfers in batches]): one event each.
    assert 0 < len(stores) <= stats.num_offloaded
    assert sum(e["args"]["bytes"] for e in stores) == stats.offloaded_bytes
    assert sum(e["args"]["bytes"] for e in loads) == stats.reloaded_bytes
    assert all(e.get("dur", 0) >= 0 and {"ts", "pid", "tid"} <= e.keys() for e in events)
    assert any(e["name"] == "thread_name" for e in trace["traceEvents"])
