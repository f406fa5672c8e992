"""`ParityReport`: what :func:`tba.testing.check_parity` found, and the bit-exact comparison
it rests on."""

from __future__ import annotations

import dataclasses
import math

import torch

from tba.cache.observe.stats import format_bytes

__all__ = ["Mismatch", "ParityReport", "compare"]


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The first value that differed between the model with tba and its twin without.

    Attributes:
        step: the training step (0-based) it was found in.
        name: what differed: ``"loss"``, ``"grad of NAME"``, ``"parameter NAME"`` (after the
            optimizer step) or ``"buffer NAME"``, with NAME the qualified name in the model.
        max_abs_diff: the largest absolute difference between the two (``inf`` when their
            shapes, dtypes or presence differ; ``nan`` when a NaN stands against a number).
    """

    step: int
    name: str
    max_abs_diff: float

    def __str__(self) -> str:
        return f"step {self.step}: {self.name} differs (max abs diff {self.max_abs_diff:.3g})"


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """The verdict of :func:`tba.testing.check_parity`; ``str(report)`` reads it out.

    Attributes:
        ok: True only when every loss, gradient, parameter and buffer was bit-identical at
            every step *and* bytes really went out to the offloader and came back (with
            ``offloader="none"`` nothing is meant to move, and equality suffices).
        steps: training steps run (the run stops at the first mismatch).
        offloaded_bytes: bytes the cache wrote to the offloader over all steps.
        reloaded_bytes: bytes the cache read back over all steps.
        first_mismatch: the first value that differed, or None.
        error: the exception the model with tba raised where the model without did not (its
            step, type and message; the traceback is logged), or None. A corrupted integer
            tensor (token ids, labels) shows up this way, as an index out of range.
        offloader: the name of the offloader checked (``"host"``, ``"ssd"``, ...).
        num_compared: tensors compared at each step (losses, gradients, parameters, buffers).
        reason: one sentence saying why the check passed or failed, with what to do.
    """

    ok: bool
    steps: int
    offloaded_bytes: int
    reloaded_bytes: int
    first_mismatch: Mismatch | None
    error: str | None
    offloader: str
    num_compared: int
    reason: str

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        lines = [
            f"tba parity check: {verdict} (offloader {self.offloader!r}, {self.steps} "
            f"step{'s' if self.steps != 1 else ''})",
            f"  {self.reason}",
            f"  offloaded {format_bytes(self.offloaded_bytes)}, reloaded "
            f"{format_bytes(self.reloaded_bytes)}; {self.num_compared} tensors compared per step",
        ]
        return "\n".join(lines)


def compare(step: int, name: str, expected: torch.Tensor | None, got: torch.Tensor | None) -> Mismatch | None:
    """None when ``got`` equals ``expected`` bit for bit (``torch.equal``; NaNs at the same
    places count as equal, so a model whose plain loss is NaN can still be checked), else the
    :class:`Mismatch`."""
    if expected is None or got is None:
        return None if expected is None and got is None else Mismatch(step, name, math.inf)
    if expected.shape != got.shape or expected.dtype != got.dtype or expected.device != got.device:
        return Mismatch(step, name, math.inf)
    if torch.equal(expected, got):
        return None
    if expected.is_floating_point() or expected.is_complex():
        both_nan = expected.isnan() & got.isnan()
        if torch.equal(expected.isnan(), got.isnan()) and torch.equal(expected[~both_nan], got[~both_nan]):
            return None
    wide = torch.promote_types(expected.dtype, torch.float64)
    diff = (expected.to(wide) - got.to(wide)).abs().max().item()
    return Mismatch(step, name, float(diff))
