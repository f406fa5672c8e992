"""One configured model used from several threads at once (issue 10, item 3).

Saved-tensor hooks are thread-local in PyTorch, so each thread's forward needs its own hooks
context and forward state (as with ``nn.DataParallel`` or a serving thread pool). Eight threads
run their forwards side by side (a barrier inside the model's forward holds every thread there
until all eight have arrived), then their backwards; each thread's loss and gradients must equal
those of running the same inputs one after another without tba.
"""

from __future__ import annotations

import copy
import threading
import traceback

import pytest
import torch
from torch import nn

import tba
from tests import models

NUM_THREADS = 8
TIMEOUT_S = 60.0


class Rendezvous(nn.Module):
    """Stack's blocks with a pause between them, where a test can hold every thread."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(models.MLPBlock(32) for _ in range(4))
        self.head = nn.Linear(32, 4)
        self.pause = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                self.pause()
        return self.head(h).pow(2).mean()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Rendezvous().eval()  # no dropout: threads share the global RNG


def inputs() -> list[torch.Tensor]:
    return [models.vector_batch(100 + i) for i in range(NUM_THREADS)]


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    loss = model(x)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.timing
def test_eight_threads_share_one_configured_model_bit_exact() -> None:
    reference = make_model()
    model = copy.deepcopy(reference)
    batches = inputs()
    expected = [loss_and_grads(reference, x) for x in batches]

    results: list = [None] * NUM_THREADS
    errors: list[str] = []
    barrier = threading.Barrier(NUM_THREADS, timeout=TIMEOUT_S)
    model.pause = barrier.wait  # every forward is inside the model at once

    cache = tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                       min_offload_bytes=0, keep_last_modules=0, adaptive=False)

    def work(index: int) -> None:
        try:
            loss = model(batches[index])
            barrier.wait()  # every forward finished, every graph alive
            cache.wait_for_stores(TIMEOUT_S)  # backward reads offloaded tensors back
            barrier.wait()
            results[index] = (loss.detach(),
                              torch.autograd.grad(loss, list(model.parameters())))
        except BaseException:
            errors.append(f"thread {index}:\n{traceback.format_exc()}")
            barrier.abort()  # the others fail at once instead of waiting for the timeout

    try:
        threads = [threading.Thread(target=work, args=(i,), name=f"test-worker-{i}", daemon=True)
                   for i in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S * 3)
        hung = [t.name for t in threads if t.is_alive()]
        assert not hung, f"threads still running after {TIMEOUT_S * 3:g} s: {hung}"
        assert not errors, "\n".join(errors)
        total = cache.stats(cumulative=True)
    finally:
        model.pause = lambda: None
        cache.close()

    names = [n for n, _ in model.named_parameters()]
    for index, ((loss_ref, grads_ref), (loss, grads)) in enumerate(zip(expected, results)):
        assert torch.equal(loss_ref, loss), f"thread {index}: loss {loss.item()} != {loss_ref.item()}"
        for name, g_ref, g in zip(names, grads_ref, grads):
            assert torch.equal(g_ref, g), f"thread {index}: grad of {name} differs"
    # Every thread's activations were managed by the cache, written out and read back.
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0, total
    single = copy.deepcopy(reference)
    with tba.configure_tensor_cache(single, offloader="none", offload_devices=("cpu",),
                                    min_offload_bytes=0) as one:
        loss_and_grads(single, batches[0])
        packed_per_forward = one.stats().num_packed
    assert total.num_packed == NUM_THREADS * packed_per_forward, (total, packed_per_forward)


def test_threads_then_main_thread_training_still_bit_exact() -> None:
    # After threaded use the cache still serves the training thread: one sequential step each.
    reference = make_model()
    model = copy.deepcopy(reference)
    batches = inputs()
    errors: list[str] = []

    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, keep_last_modules=0,
                                    adaptive=False) as cache:
        def work(index: int) -> None:
            try:
                loss_and_grads(model, batches[index])
            except BaseException:
                errors.append(f"thread {index}:\n{traceback.format_exc()}")

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), f"threads still running after {TIMEOUT_S:g} s"
        assert not errors, "\n".join(errors)
        for x in batches[:3]:
            loss = model(x)
            cache.wait_for_stores(TIMEOUT_S)
            got = (loss.detach(), torch.autograd.grad(loss, list(model.parameters())))
            want = loss_and_grads(reference, x)
            assert torch.equal(got[0], want[0])
            assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert cache.stats().reloaded_bytes > 0
