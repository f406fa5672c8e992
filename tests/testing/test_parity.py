"""``tba.testing.check_parity`` on models that tba handles: it passes only when bytes moved, and
says why when nothing did."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import tba
from tba.testing import ParityReport, check_parity
from tests.testing import factories

pytest.importorskip("transformers")


def ssd(tmp_path: Path) -> dict:
    return {"offloader": "ssd", "ssd_dirs": (str(tmp_path),), "ssd_engine": "posix"}


@pytest.mark.parametrize("where", ["host", "ssd", "host+ssd"])
def test_gpt2_passes_with_bytes_moved(where: str, tmp_path: Path) -> None:
    options = {"offloader": where}
    if "ssd" in where:
        options.update(ssd(tmp_path), offloader=where)
    if where == "host+ssd":
        options["host_budget_bytes"] = 64 << 10  # most tensors spill to the SSD
    report = check_parity(factories.gpt2(), factories.lm_batches(3), force=True, **options)
    assert report.ok, str(report)
    assert report.steps == 3 and report.first_mismatch is None and report.error is None
    assert report.offloaded_bytes > 0 and report.reloaded_bytes > 0
    assert report.offloader == where
    num_params = len(list(factories.gpt2().parameters()))
    assert report.num_compared == 1 + 2 * num_params + len(list(factories.gpt2().buffers()))
    text = str(report)
    assert text.startswith(f"tba parity check: PASS (offloader '{where}', 3 steps)")
    assert "offloaded " in text and "MiB" in text and "bit-identical" in text


def test_gpt2_passes_with_the_users_own_settings() -> None:
    """Without force the user's options are used as given: here they send the big tensors out."""
    report = check_parity(factories.gpt2(), factories.lm_batches(3), offloader="host",
                          offload_devices=("cpu",), min_offload_bytes=8192, adaptive=False)
    assert report.ok, str(report)


def test_a_run_that_moved_nothing_is_not_a_pass() -> None:
    # The default offload_devices is ("cuda",): a CPU model offloads nothing (and the cache warns).
    with pytest.warns(UserWarning, match="offloaded nothing"):
        report = check_parity(factories.gpt2(), factories.lm_batches(2), offloader="host")
    assert not report.ok and report.first_mismatch is None
    assert report.offloaded_bytes == 0
    assert "nothing was offloaded" in report.reason and "offload_devices=('cpu',)" in report.reason
    assert str(report).startswith("tba parity check: FAIL")
    # Every tensor under min_offload_bytes: the hint is force=True.
    with pytest.warns(UserWarning, match="below min_offload_bytes"):
        report = check_parity(factories.gpt2(), factories.lm_batches(2), offloader="host",
                              offload_devices=("cpu",), min_offload_bytes=1 << 40)
    assert not report.ok and "force=True" in report.reason


class _SavedButUnused(torch.autograd.Function):
    """Saves its input for backward and never reads it back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _NeverReads(torch.nn.Module):
    """The saved tensor is saved by the model itself, outside its one block (``unused``), where
    no prefetch reads it back (a model without submodules is one block, and that block's
    backward would prefetch it whenever its store finished first: a flaky premise)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(64))
        self.unused = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavedButUnused.apply(x + self.bias).sum()


def test_a_run_that_read_nothing_back_is_not_a_pass() -> None:
    report = check_parity(_NeverReads(), [torch.randn(32, 64) for _ in range(2)], force=True)
    assert not report.ok and report.offloaded_bytes > 0 and report.reloaded_bytes == 0
    assert "nothing was read back" in report.reason


def test_offloader_none_passes_without_moving_bytes() -> None:
    report = check_parity(factories.gpt2(), factories.lm_batches(2), offloader="none", offload_devices=("cpu",))
    assert report.ok and report.offloaded_bytes == 0 and report.offloader == "none"


def test_batches_as_tuples_and_tensors_and_buffers_compared() -> None:
    report = check_parity(factories.stack(), factories.vector_batches(3), force=True)
    assert report.ok, str(report)
    lone = [batch[0] for batch in factories.vector_batches(2)]
    assert check_parity(factories.stack(), lone, force=True).ok
    # BatchNorm's running statistics are buffers; a custom loss and optimizer factory.
    targets = [torch.randn(8, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    made = []

    def sgd(params):
        made.append(torch.optim.SGD(params, lr=0.1, momentum=0.9))
        return made[-1]

    report = check_parity(
        factories.NormNet(), [(torch.randn(8, 16), t) for t in targets], force=True,
        loss_fn=lambda model, batch: (model(batch[0]) - batch[1]).pow(2).mean(), optimizer=sgd,
    )
    assert report.ok, str(report)
    assert len(made) == 2 and all(opt.state for opt in made)  # one per model, and stepped
    assert report.num_compared == 1 + 2 * 12 + 6  # loss, 12 grads and params, 6 buffers


def test_a_model_changing_its_inputs_in_place_sees_the_same_batch_in_both_runs() -> None:
    class Doubles(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            for block in self.blocks:
                x = block(x).relu()
            return x.pow(2).mean()

    batches = [{"x": batch[0]} for batch in factories.vector_batches(2)]
    assert check_parity(Doubles(), batches, force=True).ok


def test_the_reference_is_the_given_model_trained(tmp_path: Path) -> None:
    model = factories.stack()
    before = [p.detach().clone() for p in model.parameters()]
    model.eval()
    assert check_parity(model, factories.vector_batches(2), force=True).ok
    assert model.training
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert tba.integrations.registry.lookup(model) is None  # the twin's cache is closed, not the model's


def test_the_callers_random_generators_are_given_back() -> None:
    model, batches = factories.stack(), factories.vector_batches(2)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    check_parity(model, batches, force=True)
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_every_generator_is_reseeded_identically_each_step() -> None:
    """A model drawing from python's and numpy's generators (as data augmentation does) gives
    the same result twice only if both runs see the same draws at each step."""

    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * random.random() + float(np.random.rand()) + torch.rand(1)
            for block in self.blocks:
                x = torch.nn.functional.dropout(block(x).tanh(), 0.5)
            return x.pow(2).mean()

    assert check_parity(Noisy(), factories.vector_batches(3), force=True).ok


def test_plain_pytorch_is_made_to_repeat_itself_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from tba.testing import _parity

    calls = []
    monkeypatch.setattr(_parity, "initialise_vector_math", lambda: calls.append("vml"))
    check_parity(factories.stack(), factories.vector_batches(1), force=True)
    assert calls == ["vml"]


def test_stores_complete_before_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    waits = []
    real = tba.TensorCache.wait_for_stores
    monkeypatch.setattr(tba.TensorCache, "wait_for_stores",
                        lambda self, timeout_s=60.0: (waits.append(timeout_s), real(self, timeout_s))[1])
    check_parity(factories.stack(), factories.vector_batches(3), force=True, store_timeout_s=7.5)
    assert waits == [7.5, 7.5, 7.5]


def test_force_sets_every_knob_and_refuses_contradictions() -> None:
    from tba.testing._parity import _resolve_options

    forced = _resolve_options({}, True, {"cpu"}, 0.0, 1.0)
    assert forced == {"min_offload_bytes": 0, "adaptive": False, "keep_last_modules": 0,
                      "activation_budget_bytes": None, "offload_devices": ("cpu",)}
    assert _resolve_options({"offload_devices": ("cuda",)}, True, {"cpu"}, 0.0, 1.0)["offload_devices"] == ("cuda",)
    with pytest.raises(ValueError) as info:
        check_parity(factories.stack(), factories.vector_batches(1), force=True, min_offload_bytes=1024,
                     adaptive=True, colour="blue", store_timeout_s=-1)
    message = str(info.value)
    assert message.startswith("invalid tba.testing.check_parity options:")
    for part in ("min_offload_bytes=1024 with force=True", "adaptive=True with force=True",
                 "colour: unknown option", "store_timeout_s=-1"):
        assert part in message


@pytest.mark.parametrize("bad, message", [
    (dict(batches=[]), "no batches"),
    (dict(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), "expected a factory"),
    (dict(optimizer=lambda params: None), "returned None, expected a torch.optim.Optimizer"),
    (dict(batches=[3]), "a batch is a int"),
    (dict(loss_fn=lambda model, batch: model(*batch).detach()), "does not require grad"),
    (dict(loss_fn=lambda model, batch: torch.ones(2, requires_grad=True)), "a tensor of shape (2,)"),
    (dict(sanitize=True), "sanitize=True needs a model on CUDA"),
    (dict(offloader="tape"), "invalid tba.TensorCacheConfig"),
])
def test_bad_input_is_a_clear_error(bad: dict, message: str) -> None:
    kwargs = {"batches": factories.vector_batches(1), "force": True, **bad}
    with pytest.raises(ValueError, match="tba") as info:
        check_parity(factories.stack(), **kwargs)
    assert message in str(info.value)


def test_an_output_without_a_loss_is_a_clear_error() -> None:
    batches = [{"input_ids": b["input_ids"]} for b in factories.lm_batches(1)]
    with pytest.raises(ValueError, match="no loss .*labels"):
        check_parity(factories.gpt2(), batches, force=True)


def test_the_report_is_frozen() -> None:
    report = check_parity(factories.stack(), factories.vector_batches(1), force=True)
    assert isinstance(report, ParityReport)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.ok = False  # type: ignore[misc]


def test_docstring_examples_run() -> None:
    import doctest

    import tba.testing
    from tba.offloaders import throttled, wrapper
    from tba.testing import _broken, _chaos, _determinism, _fakes, _parity, _step_timing

    for module in (tba.testing, _parity, _chaos, _determinism, wrapper, throttled, _fakes,
                   _broken, _step_timing):
        result = doctest.testmod(module, raise_on_error=False, verbose=False, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__


@pytest.mark.gpu
def test_gpt2_on_cuda_with_chaos_under_the_stream_sanitizer() -> None:
    model = factories.gpt2().cuda()
    batches = [{k: v.cuda() for k, v in b.items()} for b in factories.lm_batches(3)]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        report = check_parity(model, batches, offloader="host", force=True, chaos=True, chaos_max_delay_s=0.005)
    finally:
        torch.use_deterministic_algorithms(False)
    assert report.ok, str(report)
