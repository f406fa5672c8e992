"""tba's place in PyTorch's stack of saved-tensor hooks: chained to the script's own pair,
stepping aside in ``skip_modules``, and the one pair a saved tensor may have.

Note [Outer saved-tensor hooks]: PyTorch keeps one stack of default saved-tensor hook pairs per
thread and calls only the top pair for a save. tba enters its pair at the start of each
outermost forward of the configured model, so a pair the script entered around that forward
(activation compression, a memory tracker, another offloader, ``save_on_cpu``,
``allow_mutation_on_saved_tensors``) would be shadowed: its pack would never see the model's
saves and results would change without a word. So at the start of each forward tba looks at
the top of the stack once (the forward of a script without hooks of its own pays that one
look and nothing per save) and, when it holds the script's pair, enters a chained pair:

- pack(t) = the outer pack's result ``p``; when ``t`` is not a parameter (Note [Parameters
  are never offloaded] in saving.py) and ``p`` is a tensor tba manages (or a tuple or list
  holding such tensors), tba manages ``p`` (those items) as if autograd had saved it: a
  pack that keeps a bf16 copy has that copy offloaded. Anything else (a handle object, a
  tensor on a device outside ``offload_devices``) stays with the outer hooks as it is.
- unpack = tba's unpack of what it manages, then the outer unpack.

Every save reaches the outer pack exactly as without tba, and the outer unpack receives what
its pack returned, with equal values (a tensor tba managed comes back as an equal tensor,
not the same object). Results equal those of the same script without tba. Autograd checks no
version of a tensor saved under hooks; tba checks the tensors it manages (Note [Saved-version
check]) and hands the rest back unchecked, as PyTorch does. A pair of another tba cache (a
configured model run inside another) is transparent: the inner cache manages its model's
saves and chains to the script's pair below, if any. Hooks the script enters *inside* the
model's forward are on top of tba's there and get those saves alone, as in plain PyTorch.

Note [Stepping aside]: inside a module named by ``skip_modules`` tba takes its pair off the
stack (when it is on top) and puts it back when the module returns: those saves get no hook
from tba (the script's outer pair, if any, gets them), are never offloaded, and
``grad_fn._raw_saved_*.register_hooks(...)`` works there (PyTorch allows one pair per saved
tensor: Note [register_hooks on a saved tensor] in tba/_torch_compat.py). A forward whose
pair is stepped aside when it ends (an interrupt that skipped the module's post hook) leaves
the stack alone. (``ThreadState.enter_skipped``, ``leave_skipped`` and ``leave_hooks`` in
forward_state.py.)
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from tba import _torch_compat as compat
from tba.cache.capture.packed import PackedSubclass
from tba.cache.capture.saving import SavedTensors
from tba.cache.engine import Handle
from tba.errors import TBAError

__all__ = ["ChainedHooks", "PackedItems", "hooks_for_forward", "outer_pair", "attach", "detach"]

_TENSOR = torch.Tensor


class PackedItems:
    """A tuple or list from the outer pack with some items managed by tba."""

    __slots__ = ("cls", "items")

    def __init__(self, cls: type[tuple[Any, ...]] | type[list[Any]], items: list[Any]) -> None:
        self.cls, self.items = cls, items


class ChainedHooks:
    """The pair entered when the script's own pair was on top (Note [Outer saved-tensor hooks]).

    Args:
        pack: tba's pack hook for this forward.
        saved: tba's saved tensors (its unpack and parameter check).
        outer_pack, outer_unpack: the script's pair.
        on_passed: called with the outer pack when its result stays with the outer hooks
            (the "nothing was offloaded" diagnosis, while it samples), or None.
    """

    __slots__ = ("_pack", "_saved", "outer_pack", "outer_unpack", "_on_passed")

    def __init__(
        self,
        pack: Callable[[torch.Tensor], Any],
        saved: SavedTensors,
        outer_pack: Callable[[torch.Tensor], Any],
        outer_unpack: Callable[[Any], torch.Tensor],
        on_passed: Callable[[Any], None] | None,
    ) -> None:
        self._pack = pack
        self._saved = saved
        self.outer_pack = outer_pack
        self.outer_unpack = outer_unpack
        self._on_passed = on_passed

    def pack(self, tensor: torch.Tensor) -> Any:
        packed = self.outer_pack(tensor)
        cls = type(packed)
        if cls is tuple or cls is list:
            if any(isinstance(i, _TENSOR) for i in packed) and not self._saved.is_parameter(tensor):
                items = [self._manage(i) if isinstance(i, _TENSOR) else i for i in packed]
                if any(type(i) is Handle or type(i) is PackedSubclass for i in items):
                    return PackedItems(cls, items)
        elif isinstance(packed, _TENSOR) and not self._saved.is_parameter(tensor):
            managed = self._manage(packed)
            if managed is not packed:
                return managed
        if self._on_passed is not None:
            self._on_passed(self.outer_pack)
        return packed

    def _manage(self, tensor: torch.Tensor) -> Any:
        """tba's handle of ``tensor``, or ``tensor`` itself when tba leaves it alone."""
        packed = self._pack(tensor)
        cls = type(packed)
        return packed if cls is Handle or cls is PackedSubclass else tensor

    def unpack(self, packed: Any) -> torch.Tensor:
        cls = type(packed)
        if cls is Handle or cls is PackedSubclass:
            packed = self._saved.unpack(packed)
        elif cls is PackedItems:
            unpack = self._saved.unpack
            packed = packed.cls(
                unpack(i) if type(i) is Handle or type(i) is PackedSubclass else i
                for i in packed.items
            )
        return self.outer_unpack(packed)


def _owner(unpack: Callable[[Any], torch.Tensor]) -> SavedTensors | ChainedHooks | None:
    """The tba object whose method ``unpack`` is, or None for the script's own hooks."""
    owner = getattr(unpack, "__self__", None)
    return owner if isinstance(owner, (SavedTensors, ChainedHooks)) else None


def hooks_for_forward(
    pack: Callable[[torch.Tensor], Any],
    saved: SavedTensors,
    on_passed: Callable[[Any], None] | None,
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """The pair a forward beginning now enters: tba's (``pack`` and ``saved.unpack``), or a
    chain to the script's pair when one is on top (once per forward)."""
    outer = outer_pair()
    if outer is None:
        return pack, saved.unpack
    chained = ChainedHooks(pack, saved, outer[0], outer[1], on_passed)
    return chained.pack, chained.unpack


def outer_pair() -> tuple[compat.PackHook, compat.UnpackHook] | None:
    """The script's pair that a forward beginning now must chain to, or None (no hooks, or
    tba's own plain pair on top). Once per forward: Note [Outer saved-tensor hooks]."""
    top = compat.top_saved_tensors_hooks()
    if top is None:
        return None
    owner = _owner(top[1])
    if owner is None:
        return top
    if isinstance(owner, ChainedHooks):  # another cache's chain: chain to the same pair
        return owner.outer_pack, owner.outer_unpack
    return None


# ---------------------------------------------------------------------------- register_hooks
_lock = threading.Lock()
_num_caches = 0


def attach() -> None:
    """A cache was made: the first one wraps ``SavedTensor.register_hooks`` (Note
    [register_hooks on a saved tensor])."""
    global _num_caches
    with _lock:
        _num_caches += 1
        if _num_caches == 1:
            compat.wrap_saved_tensor_register_hooks(_register_hooks_error)


def detach() -> None:
    """A cache closed (or was collected): the last one puts the original method back."""
    global _num_caches
    with _lock:
        _num_caches = max(0, _num_caches - 1)
        if _num_caches == 0:
            compat.unwrap_saved_tensor_register_hooks()


def _register_hooks_error(error: RuntimeError) -> TBAError | None:
    """The TBAError for PyTorch's "hooks have already been set" when tba's own pair is the one
    active (the tensor was saved inside a configured forward); None otherwise (PyTorch's
    error then stands: it would be raised without tba too)."""
    if "already been set" not in str(error):
        return None
    top = compat.top_saved_tensors_hooks()
    owner = _owner(top[1]) if top is not None else None
    if not isinstance(owner, SavedTensors):
        return None
    module = _calling_module()
    units = [u[0].name or "the model" for u in owner.tracker.local.forward.units]
    where = f" in unit {units[-1]!r}" if units else ""
    example = (
        f"skip_modules=({type(module).__name__},) or the module's qualified name"
        if module is not None else "skip_modules=('<qualified name of that module>',)"
    )
    return TBAError(
        "tba: register_hooks on a saved tensor (grad_fn._raw_saved_*) cannot take effect "
        "here: PyTorch allows one pack/unpack pair per saved tensor, and this tensor was saved "
        "inside the forward of a model configured with tba" + where + ", while tba's "
        "saved-tensor hooks were active, so it already has tba's pair. Name the module that "
        f"calls register_hooks in skip_modules ({example}): tba then steps aside inside that "
        "module, whose saved tensors get no hooks from tba (and are not offloaded)"
    )


def _calling_module() -> nn.Module | None:
    """The innermost module whose code called register_hooks (from the stack)."""
    frame: FrameType | None = sys._getframe(3)
    for _ in range(32):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, nn.Module):
            return candidate
        frame = frame.f_back
    return None
