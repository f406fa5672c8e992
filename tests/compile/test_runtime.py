"""tba.compile.runtime on its own: what a reload checks of the tensor the cache hands back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tba.compile import runtime


class _Saved:
    """Stands in for the cache's SavedTensors: hands back what it was given."""

    def unpack(self, value: Any) -> torch.Tensor:
        assert isinstance(value, torch.Tensor)
        return value


def _key(*members: torch.Tensor) -> torch.Tensor:
    key = torch.empty(1, dtype=torch.uint8)
    setattr(key.untyped_storage(), runtime.KEY_ATTR, (_Saved(), list(members)))
    return key


@pytest.mark.parametrize("geometry", [((2, 3), (3, 1)), ((3, 1, 4), (4, 12, 1)), ((), ())])
def test_a_reload_hands_back_the_member_with_the_geometry_its_carrier_describes(
        geometry: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    size, stride = geometry
    member = torch.empty_strided(size, stride)
    carrier = runtime.carrier(member)
    assert carrier.numel() == 0 and runtime.geometry(carrier, member.dim()) == (list(size), list(stride))
    assert runtime.reload(_key(torch.empty(1), member), carrier, 1, member.dim()) is member


@pytest.mark.parametrize("returned", [
    torch.empty(3, 2),  # another size
    torch.empty(2, 3).t().contiguous().t(),  # the size, other strides
])
def test_a_reload_whose_tensor_is_not_what_its_store_saw_is_a_tba_bug(returned: torch.Tensor) -> None:
    carrier = runtime.carrier(torch.empty(2, 3))
    with pytest.raises(AssertionError, match="tba bug: reload of member 0 returned size"):
        runtime.reload(_key(returned), carrier, 0, 2)


def test_a_key_that_lost_what_its_store_packed_is_a_tba_bug() -> None:
    carrier = runtime.carrier(torch.empty(2))
    with pytest.raises(AssertionError, match="no longer carries what its store packed"):
        runtime.reload(torch.empty(1, dtype=torch.uint8), carrier, 0, 1)
