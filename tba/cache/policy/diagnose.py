"""Why nothing was offloaded: a sample of what the first steps saved, and one warning.

Note [Loud when it does nothing]: a cache that offloads nothing trains bit-exact, so without a
word from tba the user finds out only from memory that did not go down. After the first
completed step that offloaded nothing (with a real offloader), the cache warns once, naming
every reason it can see with numbers: saved tensors on devices outside ``offload_devices``;
the largest managed storage below ``min_offload_bytes``; nothing saved at all (forward without
grad, or the whole model inside a reentrant ``checkpoint``, whose forward runs without grad and
whose recomputation runs inside backward, where tba steps aside); the adaptive policy keeping
every block (with its measurements); stores queued but cancelled or failed.

Cost: the reasons need to know what was saved and not managed, which the pack hook (the hot
path) does not record. While no step has offloaded anything and no warning was given, forwards
enter a wrapped pack hook that calls the real one and then counts its result (one extra Python
call and a few attribute reads per saved tensor). The first step that offloads something, or
the warning, ends the sampling: from then on forwards enter the bare pack hook, and each step
end costs a few comparisons. Tested by tests/cache/test_diagnose.py.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tba import _torch_compat as compat
from tba.cache.engine import Handle
from tba.cache.observe.stats import CacheStats, format_bytes
from tba.cache.policy.boundary import Boundary
from tba.config import TensorCacheConfig

__all__ = ["NoOffloadDiagnosis"]


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter (trainable or frozen), or a view of one (``linear`` saves ``weight.t()``)."""
    base = tensor._base if tensor._base is not None else tensor
    return (base.requires_grad and base.is_leaf) or isinstance(base, torch.nn.Parameter)


class _Sample:
    """What the forwards of one step saved (counted by the wrapped pack hook)."""

    def __init__(self) -> None:
        self.num_unmanaged: collections.Counter[str] = collections.Counter()  # by device type
        self.max_unmanaged_bytes: dict[str, int] = {}
        self.num_managed = 0
        self.max_managed_bytes = 0
        self.num_kept_by_policy = 0  # managed, large enough, not marked for offload
        self.num_marked = 0  # entries marked for offload
        self.num_passed = 0  # on offload_devices, of a kind tba leaves to autograd
        # Saves the script's own pack kept (Note [Outer saved-tensor hooks]).
        self.num_outer_passed = 0
        self.outer_pack: Any = None

    @property
    def num_saved(self) -> int:
        return (self.num_managed + sum(self.num_unmanaged.values()) + self.num_passed
                + self.num_outer_passed)


class NoOffloadDiagnosis:
    """Samples the saves of the first steps and warns once when a step offloaded nothing.

    Args:
        config: the cache's configuration.
        boundary: the offloaded-block boundary (and the adaptive decision).
        offloading: whether the cache has an offloader (with ``"none"`` nothing is meant to go).
        blocks_note: how the blocks were chosen when the model has no repeated blocks (named
            in the reasons), or None.
    """

    def __init__(
        self, config: TensorCacheConfig, boundary: Boundary, offloading: bool,
        blocks_note: str | None = None,
    ) -> None:
        self._config = config
        self._blocks_note = blocks_note
        self._boundary = boundary
        self.sampling = offloading
        self._offloading = offloading
        self._sample = _Sample()
        self._num_without_grad = 0  # forwards of the model with grad disabled, this step
        self._num_in_backward = 0  # forwards of the model run inside backward, this step
        self.warning: str | None = None  # the warning given, if any

    # ------------------------------------------------------------------ sampling
    def wrap(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """``pack`` followed by counting what it did with the tensor."""
        min_bytes = self._config.min_offload_bytes
        devices = frozenset(self._config.offload_devices)

        def sampled_pack(tensor: torch.Tensor) -> Any:
            packed = pack(tensor)
            sample = self._sample
            if type(packed) is Handle:
                entry = packed.entry
                sample.num_managed += 1
                if entry.nbytes > sample.max_managed_bytes:
                    sample.max_managed_bytes = entry.nbytes
                if entry.xfer is not None:
                    sample.num_marked += 1
                elif entry.nbytes >= min_bytes:
                    sample.num_kept_by_policy += 1
            elif type(packed) is tuple:
                if _is_parameter(tensor):
                    return packed
                kind = tensor.device.type
                if kind in devices:  # a kind tba passes through (Note [What tba manages])
                    sample.num_passed += 1
                    return packed
                sample.num_unmanaged[kind] += 1
                try:
                    nbytes = tensor.untyped_storage().nbytes()
                except (NotImplementedError, RuntimeError):
                    nbytes = 0  # torch.func wrappers have no storage
                if nbytes > sample.max_unmanaged_bytes.get(kind, -1):
                    sample.max_unmanaged_bytes[kind] = nbytes
            return packed

        compat.keep_dynamo_out(sampled_pack)  # Note [tba under torch.compile]
        return sampled_pack

    def outer_passed(self, outer_pack: Any) -> None:
        """The script's own pack hook returned something tba does not manage (Note [Outer
        saved-tensor hooks]): that save stays with the script's hooks."""
        sample = self._sample
        sample.num_outer_passed += 1
        sample.outer_pack = outer_pack

    def forward_skipped(self, in_backward: bool) -> str | None:
        """A forward of the model ran with grad disabled (``in_backward``: as a recomputation
        inside backward). Gives and returns the warning due now, if any: a recomputation of the whole
        model inside backward, before anything was offloaded, means the model runs inside a
        reentrant checkpoint and no step will ever offload anything."""
        if in_backward:
            self._num_in_backward += 1
        else:
            self._num_without_grad += 1
        if not (in_backward and self.sampling and self._sample.num_saved == 0):
            return None
        return self._warn(
            "tba: nothing is offloaded: the model's forward ran again inside backward, so the "
            "whole model runs inside a reentrant torch.utils.checkpoint (use_reentrant=True): "
            f"its forward runs without grad ({self._num_without_grad} forward(s) without grad "
            "so far) and saves nothing, and tba steps aside while backward recomputes it. "
            "Checkpoint blocks inside the model instead (or pass use_reentrant=False), or drop "
            "the checkpoint and let tba offload the activations"
        )

    # ------------------------------------------------------------------ step end
    def step_finished(
        self, step: CacheStats, step_number: int, renumbered: bool = False
    ) -> str | None:
        """A step finished with counters ``step``: gives (and returns) the warning if it
        offloaded nothing and the evidence is not a passing accident.

        While no step has offloaded anything, every reason counts, except that stores which
        were all cancelled (a step shorter than a store: timing) must happen in a second step
        too, and a step whose forward numbered the blocks again (``renumbered``: Note [Blocks
        in run order]; it kept the tail of the declared order) is judged by the next step.
        Once a step has offloaded, only a decision of the adaptive policy to keep every
        block is warned about; one step that happens to finish before its stores is not.
        Sampling ends with the first step that offloaded or with the warning."""
        sample, self._sample = self._sample, _Sample()
        sampled = self.sampling
        without_grad, in_backward = self._num_without_grad, self._num_in_backward
        self._num_without_grad = self._num_in_backward = 0
        if not self._offloading or self.warning is not None:
            return None
        if step.offloaded_bytes > 0:
            self.sampling = False
            return None
        if sampled:
            if renumbered:
                return None
            reasons = self.reasons(step, sample, without_grad, in_backward)
            only_cancelled = sample.num_marked > 0 and len(reasons) == 1 and not step.num_io_errors
            if only_cancelled and step_number < 2:
                return None
        elif self._boundary.decision is not None and self._boundary.decision.tail_start == 0:
            # The decision, not the next step's boundary: the closed loop's keep steps while
            # it measures are no decision to keep every block.
            reasons = [self._policy_reason(None)]
        else:
            return None
        return self._warn(
            f"tba: step {step_number} offloaded nothing ({step.num_packed} saved tensors "
            f"managed, {format_bytes(step.kept_bytes)} kept in memory): " + "; ".join(reasons)
            + ". (This warning is shown once; cache.summary() repeats it.)"
        )

    def step_dropped(self) -> None:
        """The step ended with every forward of it interrupted: no step, no evidence (what the
        interrupted forwards saved is not what a step saves)."""
        self._sample = _Sample()
        self._num_without_grad = self._num_in_backward = 0

    def _warn(self, message: str) -> str:
        self.warning = message
        self.sampling = False
        warnings.warn(message, UserWarning, stacklevel=1)
        return message

    def reasons(
        self, step: CacheStats, sample: _Sample, without_grad: int, in_backward: int
    ) -> list[str]:
        """Every reason the evidence (``sample``, ``step``) supports, most basic first."""
        config = self._config
        out: list[str] = []
        if sample.num_saved == 0:
            skipped = []
            if without_grad:
                skipped.append(f"{without_grad} forward(s) of the model ran with grad disabled")
            if in_backward:
                skipped.append(f"{in_backward} ran inside backward (reentrant checkpoint)")
            out.append(
                "no tensor saved for backward reached tba during the step's forward "
                + (f"({', '.join(skipped)}) " if skipped else "")
                + "(run the forward with grad enabled and outside a reentrant "
                "torch.utils.checkpoint; nothing saves activations when nothing requires grad"
                + (f"; tba steps aside inside skip_modules={config.skip_modules!r}"
                   if config.skip_modules else "")
                + ")"
            )
        if sample.num_outer_passed:
            name = getattr(sample.outer_pack, "__qualname__", None) or repr(sample.outer_pack)
            out.append(
                f"{sample.num_outer_passed} save(s) went to the script's own saved-tensor hooks "
                f"(pack hook {name}), entered around the model's forward, whose pack returned "
                "something tba does not manage (not a tensor on offload_devices): tba passes "
                "those to the script's hooks as they are (docs/guarantees.md)"
            )
        if sample.num_passed and not sample.num_managed:
            out.append(
                f"{sample.num_passed} saved tensor(s) on {config.offload_devices!r} are of kinds "
                "tba leaves to autograd (no bytes of their own: meta, zero and empty tensors; "
                "sparse, strided nested and quantized tensors; conjugate and negative views; "
                "subclasses other than DTensor, jagged NestedTensor and float8; "
                "docs/guarantees.md)"
            )
        if sample.num_unmanaged:
            kinds = ", ".join(
                f"{n} on {kind} (largest storage {format_bytes(sample.max_unmanaged_bytes[kind])})"
                for kind, n in sorted(sample.num_unmanaged.items())
            )
            wanted = tuple(sorted(sample.num_unmanaged))
            largest = max(sample.max_unmanaged_bytes.values())
            also = (
                f", and lower min_offload_bytes={config.min_offload_bytes}: their largest "
                f"storage is {format_bytes(largest)}"
                if largest < config.min_offload_bytes else ""
            )
            out.append(
                f"saved tensors on devices tba does not manage: {kinds}, but "
                f"offload_devices={config.offload_devices!r} (pass offload_devices={wanted!r} "
                f"to offload them{also})"
            )
        stores = (
            f"stores were queued but none completed: {step.num_cancelled} cancelled (backward "
            "needed the tensor, or it died, before its store ran: the step is shorter than a "
            f"store) and {step.num_io_errors} failed and were kept in memory"
        )
        if sample.num_managed and sample.num_marked == 0 and sample.num_kept_by_policy == 0:
            out.append(
                f"the largest saved storage on {config.offload_devices!r} is "
                f"{format_bytes(sample.max_managed_bytes)} ({sample.max_managed_bytes} bytes), "
                f"below min_offload_bytes={config.min_offload_bytes} "
                f"({format_bytes(config.min_offload_bytes)}): smaller storages stay in memory "
                "(lower min_offload_bytes; 0 offloads every size)"
            )
        if sample.num_kept_by_policy and not sample.num_marked:
            out.append(self._policy_reason(sample.num_kept_by_policy))
        if sample.num_marked:
            out.append(stores)
        return out

    def _policy_reason(self, num_kept: int | None) -> str:
        config, boundary = self._config, self._boundary
        decision = boundary.decision
        what = (
            f"{num_kept} saved storage(s) large enough to offload" if num_kept else "storages"
        )
        note = self._blocks_note
        if boundary.default_tail_start == 0 and note is not None:
            return (
                f"the model has no blocks of its own: {note}; keep_last_modules="
                f"{config.keep_last_modules} keeps all {boundary.num_blocks} of them in memory, "
                f"so {what} stayed in memory"
            )
        if boundary.default_tail_start == 0:
            return (
                f"keep_last_modules={config.keep_last_modules} keeps all {boundary.num_blocks} "
                f"blocks in memory: {what} stayed in memory (lower keep_last_modules)"
            )
        if decision is not None and decision.tail_start == 0:
            return (
                f"the adaptive policy keeps every block in memory ({decision.reason}; forward "
                f"{decision.forward_s * 1e3:.1f} ms, measured write "
                f"{format_bytes(decision.write_bytes_per_s)}/s, "
                f"{format_bytes(sum(decision.block_bytes))} offloadable per step): "
                f"{what} stayed in memory (adaptive=False offloads anyway; a faster offloader "
                "or larger steps let the policy offload)"
            )
        return (
            f"{what} were saved in the kept tail (blocks {boundary.tail_start} and later, "
            f"keep_last_modules={config.keep_last_modules}) or in skip_modules="
            f"{config.skip_modules!r}"
        )

