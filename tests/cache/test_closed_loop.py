"""Closed loop (Note [Closed loop]): the rule's boundary checked against measured step time.

Step times come from an injected clock that moves only when a block computes (1 s each) or
when the offloader moves bytes while "contention" is on: a deterministic stand-in for transfers
that take CPU or memory bandwidth from compute. No assertion rests on real time.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

import tba
from tba.cache.closed_loop import OverheadLoop
from tba.offloaders.host import HostOffloader
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_BLOCKS = 6  # keep_last_modules=1: the rule may offload blocks [0, 5)


# ---------------------------------------------------------------- the loop alone
def _measure(loop: OverheadLoop, first: int, times: dict[int, float], steps: int) -> list[int]:
    """Run ``steps`` steps from boundary ``first``, each taking ``times[boundary]``; the
    boundaries run."""
    ran, at = [], first
    for _ in range(steps):
        ran.append(at)
        at = loop.observe(at, times[at])
    ran.append(at)
    return ran


def test_accepts_the_rule_within_the_overhead() -> None:
    loop = OverheadLoop(0.05, num_samples=3)
    first = loop.start(4, [10] * 5)
    ran = _measure(loop, first, {0: 1.0, 4: 1.04}, 6)
    assert ran == [0, 4, 0, 4, 0, 4, 4]  # interleaved keep and offload steps, then settled
    assert not loop.probing and loop.candidate == 4
    assert loop.overhead == pytest.approx(0.04) and "<= max_step_overhead 5%" in loop.reason


def test_backs_off_in_proportion_to_bytes() -> None:
    # Offloading blocks [0, 4) (40 bytes) costs 20%: 0.5% per byte; 5% allows 10 bytes: block 0.
    loop = OverheadLoop(0.05, num_samples=1)
    first = loop.start(4, [10] * 5)
    ran = _measure(loop, first, {0: 1.0, 4: 1.2, 1: 1.05}, 4)
    assert ran == [0, 4, 0, 1, 1]
    assert loop.candidate == 1 and loop.reason.startswith("closed loop: step 1050.0 ms")
    # Even block 0 too expensive: keep every block.
    loop = OverheadLoop(0.05, num_samples=1)
    assert _measure(loop, loop.start(4, [10] * 5), {0: 1.0, 4: 2.0}, 2) == [0, 4, 0]
    assert loop.candidate == 0 and "keep every block" in loop.reason


def test_paired_ratios_cancel_a_slowdown_mid_check() -> None:
    # The machine slows down 2x after the second step: the groups' medians (keep 1.0 s,
    # offload 2.04 s) would read +104%, the adjacent pairs read +2%, +104%, +2%: median +2%.
    loop = OverheadLoop(0.05, num_samples=3, max_samples=3)
    assert loop.start(4, [10] * 5) == 0
    for ran_at, seconds in ((0, 1.0), (4, 1.02), (0, 1.0), (4, 2.04), (0, 2.0)):
        loop.observe(ran_at, seconds)
    assert loop.observe(4, 2.04) == 4 and not loop.probing
    assert loop.overhead == pytest.approx(0.02)
    assert (loop.keep_s, loop.offload_s) == (1.0, 2.04)


def test_disagreeing_pairs_get_more_samples() -> None:
    # Pairs reading +20%, -10%, +2% disagree by 30% > 2 x 5%: more pairs, up to 5 here. They
    # still disagree: the fastest steps decide (keep 0.8 s, offload 0.9 s: +12.5% > 5%).
    loop = OverheadLoop(0.05, num_samples=3, max_samples=5)
    at = loop.start(4, [10] * 5)
    keep = iter([1.0, 1.0, 1.0, 0.8, 1.0])
    offload = iter([1.2, 0.9, 1.02, 1.02, 1.02])
    ran = []
    while loop.probing and len(ran) < 10:
        ran.append(at)
        at = loop.observe(at, next(keep) if at == 0 else next(offload))
    assert ran == [0, 4] * 5 and at == 0  # backs off: a keep step, then blocks [0, 1)
    assert loop.overhead == pytest.approx(0.125)
    assert "fastest steps +12.5%: the pairs disagree, pairs spread -10.0% to +27.5%" in loop.reason
    # One disturbed pair (+15%) among pairs reading +2%: more pairs, then the fastest steps
    # (keep 1.0 s, offload 1.02 s: +2%) stand.
    loop = OverheadLoop(0.05, num_samples=3, max_samples=5)
    at = loop.start(4, [10] * 5)
    for seconds in (1.0, 1.15, 1.0, 1.02, 1.0, 1.02, 1.0, 1.02, 1.0):
        at = loop.observe(at, seconds)
        assert loop.probing
    assert loop.observe(4, 1.02) == 4 and not loop.probing
    assert loop.overhead == pytest.approx(0.02)


def test_back_off_bound_is_inclusive() -> None:
    # Binary-exact numbers: 32 bytes cost 25%, 1/128 per byte; 6.25% allows exactly 8 bytes,
    # which is block 0: the largest boundary within the overhead, bound included.
    loop = OverheadLoop(0.0625, num_samples=1)
    ran = _measure(loop, loop.start(4, [8] * 5), {0: 1.0, 4: 1.25, 1: 1.0625}, 4)
    assert ran == [0, 4, 0, 1, 1] and loop.candidate == 1 and not loop.probing


def test_rechecks_periodically_and_on_drift() -> None:
    loop = OverheadLoop(0.05, num_samples=1, recheck_every=3, window=2, drift=1.25)
    _measure(loop, loop.start(4, [10] * 5), {0: 1.0, 4: 1.2, 1: 1.0}, 4)
    assert loop.candidate == 1 and not loop.probing
    assert _measure(loop, 1, {1: 1.0}, 2)[-1] == 1
    assert loop.observe(1, 1.0) is None  # the third steady step: check again (a new profile)
    assert "periodic re-check after 3 steps" in loop.reason
    loop = OverheadLoop(0.05, num_samples=1, recheck_every=100, window=2, drift=1.25)
    _measure(loop, loop.start(4, [10] * 5), {0: 1.0, 4: 1.0}, 2)
    assert loop.candidate == 4 and not loop.probing
    assert _measure(loop, 4, {4: 1.2}, 2)[-1] == 4  # 1.2x: within the drift
    assert loop.observe(4, 1.3) == 4  # the median of the last 2 (1.2, 1.3) is 1.25x
    assert loop.observe(4, 1.3) is None and "step time moved 1.30x" in loop.reason


# ---------------------------------------------------------------- the cache, injected clock
class FakeClock:
    """A clock that moves only when told to (thread-safe: stores and loads advance it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def mark(self) -> float:
        with self._lock:
            return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        pass


class Contended:
    """A host offloader whose transfers, while ``seconds_per_byte`` is set, slow the step down
    by that much per byte moved (advancing the fake clock): transfers competing with compute."""

    name = "contended-host"

    def __init__(self, clock: FakeClock) -> None:
        self.inner = HostOffloader()
        self.clock = clock
        self.seconds_per_byte = 0.0

    def store(self, src: torch.Tensor):
        self.clock.advance(self.seconds_per_byte * src.numel())
        return self.inner.store(src)

    def load(self, token, dst: torch.Tensor) -> None:
        self.clock.advance(self.seconds_per_byte * dst.numel())
        self.inner.load(token, dst)

    def release(self, token) -> None:
        self.inner.release(token)

    def reserve(self, num_bytes: int) -> None:
        self.inner.reserve(num_bytes)

    def close(self) -> None:
        self.inner.close()


def test_backs_off_under_contention_and_offloads_again_bit_exact() -> None:
    """Steps 1-2 (profile) without contention: the rule allows blocks [0, 5). From step 3 each
    offloaded block costs 2% of the keep step (its bytes out and back): blocks [0, 5) measure
    +10% > 5%, so the loop backs off to [0, 2) (+4%). From step 15 contention is gone; the
    periodic re-check profiles again and measures [0, 5) at +0%: offloaded again. Every step
    bit-exact."""
    clock = FakeClock()
    offloader = Contended(clock)
    caches: list[tba.TensorCache] = []
    step_of = {"n": 0}

    def configure(cache: tba.TensorCache) -> None:
        caches.append(cache)
        cache._steps.clock = clock
        assert cache._steps.loop is not None
        cache._steps.loop.recheck_every = 4
        for block in cache.model.blocks:  # each block computes for 1 s of the fake clock
            block.register_forward_pre_hook(lambda *_: clock.advance(1.0))

    def forward(net, batch):
        if caches and net is caches[0].model:
            step_of["n"] += 1
            step, cache = step_of["n"], caches[0]
            if step == 3:  # contention from step 3: 2% of keep (6 s) per block, out and back
                block_bytes = cache.adaptive_decision.block_bytes[0]
                offloader.seconds_per_byte = 0.02 * _BLOCKS / (2 * block_bytes)
            elif step == 15:
                offloader.seconds_per_byte = 0.0
        return net(batch)

    cache = run_twins(lambda: models.Stack(num_blocks=_BLOCKS), models.vector_batch, steps=28,
                      settle=True, forward=forward, on_configure=configure, offloader=offloader,
                      offload_devices=("cpu",), min_offload_bytes=0)
    assert_bytes_moved(cache)
    tails = [t for _, _, t in probe(cache).history]
    offloaded = [s.offloaded_bytes for _, s, _ in probe(cache).history]
    # 1-2 profile at 5; 3-8 keep/5 interleaved; 9-14 keep/2; 15-18 steady at 2 (contention
    # gone from 15); 19 profiled again (periodic re-check); 20-25 keep/5; 26-28 steady at 5.
    assert tails == [5, 5] + [0, 5] * 3 + [0, 2] * 3 + [2] * 4 + [5] + [0, 5] * 3 + [5] * 3, tails
    assert all(b == 0 for b, t in zip(offloaded, tails) if t == 0), offloaded  # keep: nothing
    assert offloaded[-1] > offloaded[14] > 0  # [0, 5) moves more than [0, 2)
    decision = cache.adaptive_decision
    assert decision.tail_start == 5 and decision.rule_tail_start == 5
    assert decision.keep_step_s == pytest.approx(6.0)
    assert decision.offload_step_s == pytest.approx(6.0, abs=0.01)
    assert "<= max_step_overhead 5%" in decision.reason
    assert "step keep 6000.0 ms" in cache.summary()


def test_contention_reported_in_decision() -> None:
    """Under contention the settled decision names the measurements and the overhead."""
    clock = FakeClock()
    offloader = Contended(clock)
    torch.manual_seed(0)
    model = models.Stack(num_blocks=_BLOCKS)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        cache._steps.clock = clock
        for step in range(1, 16):
            if step == 3:
                bb = cache.adaptive_decision.block_bytes[0]
                offloader.seconds_per_byte = 0.03 * _BLOCKS / (2 * bb)  # 3% per block
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        decision = cache.adaptive_decision
    # [0, 5): +15% -> back off to [0, 1) (+3%), the largest within 5%.
    assert decision.tail_start == 1 and cache.boundary.tail_start == 1, str(decision)
    assert decision.step_overhead == pytest.approx(0.03, abs=0.005)
    # (+3.1%: the embedding's input is offloaded too, outside the blocks)
    assert re.search(r"paired ratios \+3\.\d%, pairs spread .*\) <= max_step_overhead 5%", str(decision)), str(decision)


def test_max_step_overhead_none_is_the_rule_alone() -> None:
    model = models.Stack(num_blocks=_BLOCKS)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, max_step_overhead=None) as cache:
        assert cache._steps.loop is None
        for step in range(5):
            model(models.vector_batch(step)).backward()
        assert all(t == 5 for _, _, t in probe(cache).history)


def test_max_step_overhead_is_validated() -> None:
    with pytest.raises(ValueError) as info:
        tba.TensorCacheConfig(max_step_overhead=-0.1, activation_budget_bytes=-1)
    assert "max_step_overhead=-0.1" in str(info.value)
    assert "activation_budget_bytes=-1" in str(info.value)
    for bad in ("5%", True, float("nan")):
        with pytest.raises(ValueError, match="max_step_overhead"):
            tba.TensorCacheConfig(max_step_overhead=bad)
    assert tba.TensorCacheConfig(max_step_overhead=0).max_step_overhead == 0


def test_no_keep_steps_without_memory_for_them() -> None:
    """A keep step would hold what the rule offloads: without that much memory free, the loop
    does not measure, the rule's boundary stands and the decision says why."""
    model = models.Stack(num_blocks=_BLOCKS)
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        cache._steps.free_bytes = lambda: 1000
        for step in range(6):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        decision = cache.adaptive_decision
        tails = [t for _, _, t in probe(cache).history]
    assert tails == [5] * 6, tails
    assert decision.reason.startswith("closed loop not measuring: a step keeping every block "
                                      "would hold"), decision.reason
    assert "1000 B is free" in decision.reason


@pytest.mark.gpu
def test_cuda_event_clock_reads_without_synchronising() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tba.cache.clock import CudaEventClock, default_clock

    clock = default_clock(cuda=True)
    assert isinstance(clock, CudaEventClock)
    start = clock.mark()
    torch.cuda._sleep(50_000_000)  # long enough that the end event is still pending below
    end = clock.mark()
    pending = clock.seconds(start, end)
    clock.wait(end)
    assert pending is None or pending > 0
    assert clock.seconds(start, end) > 0
