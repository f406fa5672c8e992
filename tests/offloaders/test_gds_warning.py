"""The SSD offloader warns once when GPUDirect Storage would move unregistered GPU memory."""

from __future__ import annotations

import warnings

import pytest

from tba.offloaders.ssd import _kvikio


def test_warns_once_with_the_hook_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    import tba.malloc_hook

    calls = []

    def problem() -> str:
        calls.append(1)
        return "the CUDA malloc hook is not preloaded (LD_PRELOAD=$(python -m tba.malloc_hook --path))"

    monkeypatch.setattr(tba.malloc_hook, "gds_registration_problem", problem)
    monkeypatch.setattr(_kvikio, "_warned_unregistered", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _kvikio._warn_if_unregistered()
        _kvikio._warn_if_unregistered()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "not preloaded" in messages[0] and "GPUDirect" in messages[0]
    assert len(calls) == 1


def test_silent_when_registration_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    import tba.malloc_hook

    monkeypatch.setattr(tba.malloc_hook, "gds_registration_problem", lambda: None)
    monkeypatch.setattr(_kvikio, "_warned_unregistered", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _kvikio._warn_if_unregistered()
    assert not caught
