"""Per-thread forward state of the hooks, and how an interrupted forward is recognised.

Note [Interrupted forwards]: torch runs ``always_call`` forward hooks for ``Exception`` only,
so a ``KeyboardInterrupt`` (or ``SystemExit``) raised inside the model's forward skips the
root's post hook: this thread's depth, saved-tensor hooks and record stay as they were. Two
places close such a forward: the next forward of the model (it finds no outer call of the
model on the stack), and the next save that reaches tba's pack hook after a Ctrl-C or another
signal handler's exception (tba's wrappers of the signal handlers count the exceptions they
let through, ``interrupts.interrupt_count``; a save that sees the count moved since its
forward began looks for that forward on the stack once).
So a caught Ctrl-C leaves the cache usable, and another model's forward afterwards is not
offloaded by tba's stale hooks. An ``Exception`` (a timeout's, the model's own) does reach the
root's post hook, with no output: that forward is closed there the same way. A closed forward
is no forward of its step (Note [Step boundaries] in tba/cache/steps/tracker.py).
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType

import torch

from tba import _torch_compat as compat
from tba.cache.steps.scopes import ForwardPass

__all__ = ["ThreadState", "torch_caller", "on_stack"]

# tba/ (this file is tba/cache/steps/forward_state.py): frames of tba's own code are skipped.
_TBA_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torch_caller() -> FrameType | None:
    """The first frame above tba's own: the module call that ran the hook."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TBA_DIR):
        frame = frame.f_back
    return frame


def on_stack(frame_id: int, caller: FrameType | None) -> bool:
    """Whether a frame with ``frame_id`` runs above ``caller`` (the current call's frame)."""
    frame = caller.f_back if caller is not None else None
    while frame is not None:
        if id(frame) == frame_id:
            return True
        frame = frame.f_back
    return False


class ThreadState(threading.local):
    """One thread's forward of the model: nesting depth, its saved-tensor hooks, its units."""

    def __init__(self) -> None:
        self.caller_id = 0  # id of the frame of the outermost forward call running
        self.epoch = 0  # interrupts.interrupt_count when that forward began
        self.depth = 0
        self.ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self.aside = False  # ``ctx`` is off the stack in a skipped module (Note [Stepping aside])
        # The open forward runs a graph compiled with backend="tba" (no saved-tensor hooks:
        # the graph's ops save; Note [The cache under compiled graphs]).
        self.compiled = False
        self.forward = ForwardPass()

    def leave_hooks(self) -> None:
        """This thread's forward ends: take its saved-tensor hooks off the stack (not when
        they stepped aside: they are not on it)."""
        ctx, aside = self.ctx, self.aside
        self.ctx, self.depth, self.aside, self.compiled = None, 0, False, False
        if ctx is not None and not aside:
            ctx.__exit__(None, None, None)

    def enter_skipped(self) -> None:
        """A module of ``skip_modules`` begins. The outermost one takes this forward's pair
        off the stack when it is on top (Note [Stepping aside] in
        tba/cache/capture/hook_stack.py)."""
        forward = self.forward
        forward.skip_depth += 1
        ctx = self.ctx
        if forward.skip_depth == 1 and ctx is not None:
            top = compat.top_saved_tensors_hooks()
            if top is not None and top[1] is ctx.unpack_hook:
                ctx.__exit__(None, None, None)
                self.aside = True

    def leave_skipped(self) -> None:
        """A module of ``skip_modules`` returned; the outermost one puts the pair back."""
        forward = self.forward
        if not forward.skip_depth:
            return
        forward.skip_depth -= 1
        if not forward.skip_depth and self.aside:
            self.aside = False
            if self.ctx is not None:
                self.ctx.__enter__()
