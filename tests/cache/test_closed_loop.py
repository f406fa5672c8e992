"""Closed loop (Note [Closed loop]) in the cache: the rule's boundary checked against measured
step time (the loop alone: tests/cache/test_overhead_loop.py).

Step times come from an injected clock that moves only when a block computes (1 s each) or
when the offloader moves bytes while "contention" is on: a deterministic stand-in for transfers
that take CPU or memory bandwidth from compute. No assertion rests on real time.
"""

from __future__ import annotations

import re

import pytest
import torch

import tba
from tba.offloaders import HostOffloader, OffloaderWrapper
from tba.testing import FakeStepClock, drive_closed_loop, probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_BLOCKS = 6  # keep_last_modules=1: the rule may offload blocks [0, 5)


# ---------------------------------------------------------------- the cache, injected clock
class Contended(OffloaderWrapper):
    """A host offloader whose transfers, while ``seconds_per_byte`` is set, slow the step down
    by that much per byte moved (advancing the fake clock): transfers competing with compute."""

    passes_store_now = False  # every store advances the clock, on the store worker

    def __init__(self, clock: FakeStepClock) -> None:
        super().__init__(HostOffloader(), "contended")
        self.clock = clock
        self.seconds_per_byte = 0.0

    def store(self, src: torch.Tensor):
        self.clock.advance(self.seconds_per_byte * src.numel())
        return self.inner.store(src)

    def load(self, token, dst: torch.Tensor) -> None:
        self.clock.advance(self.seconds_per_byte * dst.numel())
        self.inner.load(token, dst)


def test_backs_off_under_contention_and_offloads_again_bit_exact() -> None:
    """Steps 1-2 (profile) without contention: the rule allows blocks [0, 5). From step 3 each
    offloaded block costs 2% of the keep step (its bytes out and back): blocks [0, 5) measure
    +10% > 5%; the line through keep and them (2% a block) crosses 5% at 2.5 blocks: [0, 2)
    measured at +4% (within, and 33% of the bytes for it is worth it), and [0, 3) is predicted
    over: settled at [0, 2). From step 27 contention is gone; the periodic re-check profiles
    again and measures [0, 5) at +0% (four pairs: nothing measured above it): offloaded
    again. Every step bit-exact."""
    clock = FakeStepClock()
    offloader = Contended(clock)
    caches: list[tba.TensorCache] = []
    step_of = {"n": 0}

    def configure(cache: tba.TensorCache) -> None:
        caches.append(cache)
        drive_closed_loop(cache, clock=clock, recheck_every=4)
        for block in cache.model.blocks:  # each block computes for 1 s of the fake clock
            block.register_forward_pre_hook(lambda *_: clock.advance(1.0))

    def forward(net, batch):
        if caches and net is caches[0].model:
            step_of["n"] += 1
            step, cache = step_of["n"], caches[0]
            if step == 3:  # contention from step 3: 2% of keep (6 s) per block, out and back
                block_bytes = cache.adaptive_decision.block_bytes[0]
                offloader.seconds_per_byte = 0.02 * _BLOCKS / (2 * block_bytes)
            elif step == 27:
                settled = cache.adaptive_decision
                assert (settled.tail_start, settled.settled_at_step) == (2, 26), str(settled)
                assert (settled.probe_steps, settled.max_probe_steps) == (24, 60)
                offloader.seconds_per_byte = 0.0
        return net(batch)

    cache = run_twins(lambda: models.Stack(num_blocks=_BLOCKS), models.vector_batch, steps=50,
                      settle=True, forward=forward, on_configure=configure, offloader=offloader,
                      offload_devices=("cpu",), min_offload_bytes=0)
    assert_bytes_moved(cache)
    tails = [t for _, _, t in probe(cache).history]
    offloaded = [s.offloaded_bytes for _, s, _ in probe(cache).history]
    # 1-2 profile at 5; 3-14 runs of two keep and two at 5; 15-26 keep and 2; 27-30 steady
    # at 2 (contention gone from 27); 31 profiled again (periodic re-check); 32-47 keep and 5;
    # 48-50 steady at 5.
    assert tails == ([5, 5] + [0, 0, 5, 5] * 3 + [0, 0, 2, 2] * 3 + [2] * 4 + [5]
                     + [0, 0, 5, 5] * 4 + [5] * 3), tails
    assert all(b == 0 for b, t in zip(offloaded, tails) if t == 0), offloaded  # keep: nothing
    assert offloaded[-1] > offloaded[27] > 0  # [0, 5) moves more than [0, 2)
    decision = cache.adaptive_decision
    assert decision.tail_start == 5 and decision.rule_tail_start == 5
    assert decision.keep_step_s == pytest.approx(6.0)
    assert decision.offload_step_s == pytest.approx(6.0, abs=0.01)
    assert decision.settled_at_step == 47 and decision.probe_steps == 16
    assert "saving 83%: within 5%" in decision.reason
    assert "step keep 6000.0 ms" in cache.summary()
    assert "settled at step 47 (16 of at most 60 measured steps)" in cache.summary()


def test_contention_reported_in_decision(recwarn: pytest.WarningsRecorder) -> None:
    """Under contention the settled decision names the measurements, their bounds, the
    overhead, the measuring budget and the step it settled at. The loop's keep steps are no
    decision to keep every block: no "offloaded nothing" warning."""
    clock = FakeStepClock()
    offloader = Contended(clock)
    torch.manual_seed(0)
    model = models.Stack(num_blocks=_BLOCKS)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        drive_closed_loop(cache, clock=clock)
        for step in range(1, 29):
            if step == 3:
                bb = cache.adaptive_decision.block_bytes[0]
                offloader.seconds_per_byte = 0.03 * _BLOCKS / (2 * bb)  # 3% per block
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
            if 2 <= step < 26:  # decided at step 2, measuring until step 26
                assert cache.adaptive_decision.settled_at_step is None, step
        decision = cache.adaptive_decision
    assert not [w for w in recwarn if "offloaded nothing" in str(w.message)]
    # [0, 5): +15%: 3% a block puts [0, 1) at +3% by the line through keep, within the 3.3%
    # its saving (17% of the bytes) is worth; measured +3.1% (the embedding's input is
    # offloaded too, outside the blocks): it passes, and between it and [0, 5) the line puts
    # [0, 2) over.
    assert decision.tail_start == 1 and cache.boundary.tail_start == 1, str(decision)
    assert decision.step_overhead == pytest.approx(0.03, abs=0.005)
    assert decision.step_overhead_bounds == pytest.approx((decision.step_overhead,) * 2)
    assert (decision.settled_at_step, decision.probe_steps) == (26, 24)
    assert re.search(r"blocks \[0, 1\) \+3\.\d% \(bounds \+3\.\d% to \+3\.\d%, 3 pairs\), at most "
                     r"\+3\.\d% with the pairs of blocks \[0, 5\) scaled to its bytes, saving 17%: "
                     r"within 3\.3% \(a saving of 17% is worth no more\); blocks \[0, 1\) within, "
                     r"blocks \[0, 2\) predicted over .*; rule: .*, settled at step 26 \(24 of at "
                     r"most 60 measured steps\)\)$", str(decision)), str(decision)


@pytest.mark.timing
def test_max_step_overhead_none_is_the_rule_alone() -> None:
    # Every store completes before backward and each block computes 1 s of the fake clock: the
    # rule offloads blocks [0, 5) whatever the machine's load, and no keep step follows.
    model = models.Stack(num_blocks=_BLOCKS)
    clock = FakeStepClock()
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, max_step_overhead=None) as cache:
        assert not probe(cache).has_closed_loop
        with pytest.raises(ValueError, match="no closed loop"):
            drive_closed_loop(cache, keep_every=2)
        drive_closed_loop(cache, clock=clock)  # the clock alone needs no loop
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
        for step in range(5):
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        assert cache.adaptive_decision is not None
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
        drive_closed_loop(cache, free_bytes=lambda: 1000)
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


def test_steady_keep_steps_only_with_memory_for_them() -> None:
    """After settling, two keep steps every ``keep_every`` steady steps refresh the baseline;
    once the memory free no longer covers a keep step, none runs."""
    clock = FakeStepClock()
    model = models.Stack(num_blocks=_BLOCKS)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
    free = {"bytes": 1 << 40}
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        drive_closed_loop(cache, clock=clock, free_bytes=lambda: free["bytes"], keep_every=2)
        for step in range(1, 29):
            if step == 23:
                free["bytes"] = 1000
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        tails = [t for _, _, t in probe(cache).history]
    # 1-2 profile; 3-18 the check (no cost: settled at 5); 19-20 steady, 21-22 keep steps;
    # from 23 no memory for keep steps.
    assert tails == [5, 5] + [0, 0, 5, 5] * 4 + [5, 5, 0, 0] + [5] * 6, tails


@pytest.mark.gpu
def test_cuda_event_clock_reads_without_synchronising() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tba.cache.observe.clock import CudaEventClock, default_clock

    clock = default_clock(cuda=True)
    assert isinstance(clock, CudaEventClock)
    start = clock.mark()
    torch.cuda._sleep(50_000_000)  # long enough that the end event is still pending below
    end = clock.mark()
    pending = clock.seconds(start, end)
    clock.wait(end)
    assert pending is None or pending > 0
    assert clock.seconds(start, end) > 0


def test_drift_after_acceptance_is_caught_in_the_cache() -> None:
    """From step 3 each offloaded block costs 0.6% of the keep step: blocks [0, 5) are
    accepted at +3% (steps 3-18: four pairs, the rule's boundary passing alone). From step 21
    a block costs 1.6% (+8%): only 4.9% over the accepted time, but the steady steps are
    judged against the keep baseline (6 s), so at step 22 the median of the steady steps
    (+3%, +3%, +8%, +8%) is over 5% and a check starts at once; it measures [0, 5) over and
    backs off, within ``window + 4 * max_pairs`` steps of the change."""
    clock = FakeStepClock()
    offloader = Contended(clock)
    model = models.Stack(num_blocks=_BLOCKS)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: clock.advance(1.0))
    with tba.configure_tensor_cache(model, offloader=offloader, offload_devices=("cpu",),
                                    min_offload_bytes=0) as cache:
        drive_closed_loop(cache, clock=clock, free_bytes=lambda: 1 << 40)
        for step in range(1, 47):
            if step in (3, 21):
                per_block = 0.006 if step == 3 else 0.016
                block_bytes = cache.adaptive_decision.block_bytes[0]
                offloader.seconds_per_byte = per_block * _BLOCKS / (2 * block_bytes)
            if step == 21:
                accepted = cache.adaptive_decision
                assert (accepted.tail_start, accepted.settled_at_step) == (5, 18), str(accepted)
                assert accepted.step_overhead == pytest.approx(0.03, abs=0.002)
            loss = model(models.vector_batch(step))
            cache.wait_for_stores(60)
            loss.backward()
        events = [(e.step, e.kind, e.tail_start) for e in probe(cache).loop_events]
        tails = [t for _, _, t in probe(cache).history]
    assert events[:6] == [(2, "measure", 5), (18, "pass", 5), (18, "settle", 5),
                          (22, "suspect", 5), (22, "measure", 5), (34, "fail", 5)], events
    assert 34 - 20 <= 5 + 4 * 5  # the documented bound (window + 4 * max_pairs)
    assert tails[18:22] == [5] * 4 and tails[22:34] == [0, 0, 5, 5] * 3
    assert all(t < 5 for t in tails[34:]), tails  # backed off
