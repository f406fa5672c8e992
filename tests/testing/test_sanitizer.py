"""Note [Stream sanitizer]: the model with tba runs under PyTorch's CUDA stream sanitizer when
asked (by default with chaos on CUDA), and only it; the sanitizer is given back as it was. A fake
sanitizer stands in for PyTorch's on the CPU."""

from __future__ import annotations

import pytest
import torch

from tba.testing import _parity, _sanitizer, check_parity
from tests.testing import factories


class FakeSanitizer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.calls: list[str] = []

    def enable(self) -> None:
        self.calls.append("enable")
        self.enabled = True

    def disable(self) -> None:
        self.calls.append("disable")
        self.enabled = False


def test_the_block_runs_under_the_sanitizer_and_it_is_switched_off_after() -> None:
    fake = FakeSanitizer()
    with _sanitizer.stream_sanitizer(fake):
        assert fake.enabled
    assert fake.calls == ["enable", "disable"] and not fake.enabled
    with pytest.raises(RuntimeError), _sanitizer.stream_sanitizer(fake):
        raise RuntimeError("a race")
    assert not fake.enabled


def test_a_sanitizer_the_program_enabled_stays_on() -> None:
    fake = FakeSanitizer(enabled=True)
    with _sanitizer.stream_sanitizer(fake):
        pass
    assert fake.calls == [] and fake.enabled


def _watched(monkeypatch: pytest.MonkeyPatch, devices: set[str]) -> tuple[FakeSanitizer, torch.nn.Module, list]:
    """A fake sanitizer, a model that records whether it is on at each forward, and the records
    (reference and twin alternate)."""
    fake = FakeSanitizer()
    monkeypatch.setattr(_sanitizer, "_cuda_sanitizer", lambda: fake)
    monkeypatch.setattr(_parity, "_device_types", lambda model: devices)  # a "CUDA" model on the CPU
    model = factories.stack()
    seen: list[bool] = []
    model.register_forward_hook(lambda *args: seen.append(fake.enabled))
    return fake, model, seen


def test_chaos_on_cuda_runs_the_twin_and_only_the_twin_under_the_sanitizer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, model, seen = _watched(monkeypatch, {"cuda"})
    report = check_parity(model, factories.vector_batches(3), force=True, chaos=True, chaos_max_delay_s=0.001,
                          offload_devices=("cpu",))
    assert report.ok, str(report)
    assert seen == [False, True] * 3  # reference off, twin (the deep copy keeps the hook) on
    assert fake.calls == ["enable", "disable"] * 6 and not fake.enabled  # backward and step, 3 steps


@pytest.mark.parametrize("devices, kwargs", [
    ({"cpu"}, {"chaos": True}),  # chaos on the CPU: no CUDA streams to check
    ({"cuda"}, {"chaos": False}),  # no chaos: not by default
    ({"cuda"}, {"chaos": True, "sanitize": False}),
])
def test_no_sanitizer_unless_chaos_on_cuda_or_asked(monkeypatch: pytest.MonkeyPatch, devices, kwargs) -> None:
    fake, model, seen = _watched(monkeypatch, devices)
    check_parity(model, factories.vector_batches(1), force=True, chaos_max_delay_s=0.001,
                 offload_devices=("cpu",), **kwargs)
    assert fake.calls == [] and seen == [False, False]


def test_asking_for_it_without_chaos(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, model, seen = _watched(monkeypatch, {"cuda"})
    check_parity(model, factories.vector_batches(1), force=True, sanitize=True, offload_devices=("cpu",))
    assert seen == [False, True]


@pytest.mark.gpu
def test_pytorchs_sanitizer_is_given_back_off() -> None:
    from torch.cuda import _sanitizer as csan

    assert not csan.cuda_sanitizer.enabled
    with _sanitizer.stream_sanitizer():
        assert csan.cuda_sanitizer.enabled
        torch.ones(4, device="cuda").add_(1)
    assert not csan.cuda_sanitizer.enabled
