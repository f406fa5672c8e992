"""The private torch calls tba relies on (tba/_torch_compat.py) behave as the cache assumes."""

from __future__ import annotations

import pytest
import torch

from tba import _torch_compat as compat


def test_release_alias_frees_nothing_it_shares_and_keeps_the_version_counter() -> None:
    x = torch.randn(5, requires_grad=True)
    h = x * 2
    alias = h.detach()
    view = h[1:]
    before = h._version
    compat.release_alias(alias)
    # No transient or lasting bump: autograd refuses pack hooks that change their input's
    # version, and the saved-version check compares exact values.
    assert h._version == before and alias._version == before
    assert alias.numel() == 0 and alias.untyped_storage().nbytes() == 0
    assert h.numel() == 5 and torch.equal(h, x.detach() * 2)
    with torch.no_grad():
        view.mul_(3)  # a write through another view of the family
    assert alias._version == h._version == before + 1


def test_functorch_detection() -> None:
    from torch.func import grad

    seen = []

    def f(t: torch.Tensor) -> torch.Tensor:
        seen.append((compat.in_functorch_transform(), compat.is_functorch_wrapped(t)))
        return t.sin().sum()

    grad(f)(torch.randn(3))
    assert seen == [(True, True)]
    assert not compat.in_functorch_transform()
    assert not compat.is_functorch_wrapped(torch.randn(3))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_new_empty_makes_the_geometry_asked_on_the_device_asked(device: str) -> None:
    """CPU through Inductor's allocator, other devices (CUDA: its allocator takes no device)
    through torch.empty_strided."""
    made = compat.new_empty((2, 3, 4), (12, 1, 3), torch.float16, torch.device(device))
    assert made.shape == (2, 3, 4) and made.stride() == (12, 1, 3)
    assert made.dtype is torch.float16 and made.device.type == device
