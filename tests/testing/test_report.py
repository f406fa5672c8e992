"""The bit-exact comparison behind ``check_parity`` and how its report reads."""

from __future__ import annotations

import math

import pytest
import torch

from tba.testing import Mismatch, ParityReport
from tba.testing._report import compare


def test_equal_tensors_match_and_any_difference_is_measured() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert compare(0, "x", a, a.clone()) is None
    assert compare(0, "x", None, None) is None
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(3.0))  # one unit in the last place
    mismatch = compare(4, "grad of w", a, b)
    assert mismatch == Mismatch(4, "grad of w", pytest.approx(2.0 ** -22))
    assert str(mismatch) == "step 4: grad of w differs (max abs diff 2.38e-07)"
    assert compare(0, "x", torch.tensor([1, 5]), torch.tensor([1, 2])).max_abs_diff == 3
    assert compare(0, "x", torch.tensor([True]), torch.tensor([False])).max_abs_diff == 1


@pytest.mark.parametrize("expected, got", [
    (torch.zeros(2), None),
    (None, torch.zeros(2)),
    (torch.zeros(2), torch.zeros(3)),
    (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
])
def test_presence_shape_and_dtype_differences_are_infinite(expected, got) -> None:
    assert compare(1, "x", expected, got).max_abs_diff == math.inf


def test_nans_at_the_same_places_are_equal_elsewhere_they_differ() -> None:
    a = torch.tensor([1.0, math.nan, 3.0])
    assert compare(0, "loss", a, a.clone()) is None
    assert math.isnan(compare(0, "loss", a, torch.tensor([1.0, 2.0, 3.0])).max_abs_diff)
    assert compare(0, "loss", a, torch.tensor([1.0, math.nan, 4.0])) is not None


def test_the_report_reads_out_its_verdict() -> None:
    report = ParityReport(ok=False, steps=2, offloaded_bytes=3 << 20, reloaded_bytes=1 << 20,
                          first_mismatch=Mismatch(1, "loss", 0.5), error=None, offloader="ssd",
                          num_compared=7, reason="step 1: loss differs")
    assert str(report).splitlines() == [
        "tba parity check: FAIL (offloader 'ssd', 2 steps)",
        "  step 1: loss differs",
        "  offloaded 3.0 MiB, reloaded 1.0 MiB; 7 tensors compared per step",
    ]
