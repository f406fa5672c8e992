"""Every private torch internal tba relies on, in one place.

Checked against torch 2.4 through 2.13 (CPU and CUDA builds). If a torch release changes one
of these, this module is the only place to mend.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.autograd.profiler as _autograd_profiler

__all__ = [
    "in_backward", "local_tensor", "storage_bytes", "view_on_storage", "new_empty", "release_alias",
    "is_functorch_wrapped", "in_functorch_transform", "profiler_enabled", "is_compiling",
    "call_outside_compile", "note_traced_hook", "keep_dynamo_out", "tracing_for_tba", "running_for_tba", "is_tba_backend",
    "TBA_BACKEND_ATTR", "capturing", "STAMP_ATTR",
    "FAMILY_ATTR", "graph_task_id", "queue_end_of_backward", "top_saved_tensors_hooks",
    "wrap_saved_tensor_register_hooks", "unwrap_saved_tensor_register_hooks",
]

# Note [Storage stamps]: torch keeps one Python object per StorageImpl alive for as long as the
# storage lives (PyObject preservation, torch >= 2.0), so an attribute set on
# `t.untyped_storage()` is seen through every view of that storage and disappears with it.
# That gives storages a collision-free identity: a raw data pointer or `id()` is reused once
# the storage dies, and time-stamp ids collide when two storages are stamped in one clock tick.
# Tested in tests/cache/test_adversarial.py (fused-qkv views) and tests/cache/test_identity.py.
STAMP_ATTR = "_tba_stamp"
# The same for the root tensor of a view family (torch preserves a tensor's Python object as
# long as its TensorImpl lives): Note [Version-counter families] in tba/cache/engine/table.py.
FAMILY_ATTR = "_tba_family"


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. while
    activation checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over every byte of ``storage`` (shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def view_on_storage(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    size: torch.Size,
    stride: tuple[int, ...],
    offset: int,
) -> torch.Tensor:
    """A tensor of ``dtype`` viewing ``storage`` with the given geometry (no copy)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


# Inductor's wrapper code allocates its CPU buffers with this (no dispatcher, no argument
# parsing: a third of ``torch.empty_strided``'s cost); tba's compiled ops make their outputs
# with it on every call. Its CUDA sibling allocates on the current device, not a given one, so
# CUDA tensors take ``torch.empty_strided``.
_EMPTY_STRIDED_CPU: Callable[..., torch.Tensor] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "guards", None), "_empty_strided_cpu", None)


def new_empty(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of the given geometry on ``device``; real tensors only (never
    under a fake mode: the CPU maker bypasses the dispatcher)."""
    if device.type == "cpu" and _EMPTY_STRIDED_CPU is not None:
        return _EMPTY_STRIDED_CPU(size, stride, dtype)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s data on this rank (a DTensor's local shard)."""
    return getattr(tensor, "_local_tensor", tensor)


def release_alias(alias: torch.Tensor) -> None:
    """Point ``alias`` (a ``detach()`` alias) at an empty storage, keeping its version counter
    (shared with its view family) untouched: the family's in-place writes stay observable
    through ``alias._version`` without holding the memory (Note [Saved-version check] in
    tba/cache/engine/table.py). ``set_`` is dispatched below the ADInplaceOrView key, which is where
    in-place ops bump the counter, so no thread ever sees a transient version change (autograd
    checks that a pack hook leaves its input's version alone)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        # An empty storage of the same dtype and device; torch's stubs lack the no-argument form.
        alias.set_()  # type: ignore[call-overload]


def in_functorch_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, vjp, ...) is running on this thread; those
    refuse saved-tensor hooks ("don't yet support saved tensor hooks")."""
    return torch._C._functorch.maybe_current_level() is not None


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch.func (functorch) wrapper: a grad or vmap level's tensor,
    whose storage cannot be reached."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (never initialises CUDA: a
    process that has not used CUDA yet cannot be capturing)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` / ``torch.autograd.profiler`` session is running: the
    module flag torch's own Python fast paths read (set on start, cleared on stop)."""
    return _autograd_profiler._is_profiler_enabled


# ---------------------------------------------------------------------------- torch.compile
# Note [tba under torch.compile]: Dynamo inlines the module hooks a compiled ``_call_impl``
# runs (tba's unit hooks under ``block.compile()``, every hook under whole-model compile) and
# would trace their bodies (thread-local state, saved-tensor hooks, locks: one graph break
# each, and worse). Instead a hook traced by Dynamo calls ``call_outside_compile``, which Dynamo
# treats as a ``torch.compiler.disable``d function: one graph break per hook call, the hook
# body runs eagerly between graphs. Those breaks are the unit boundaries tba needs anyway: the
# tensors a compiled graph saves are packed together when that graph returns (pytorch#148222),
# so without a break at each unit nothing would be offloaded before the whole forward ends.
# The saved-tensor hooks and the other Python entry points that autograd calls from C++ while
# compiled code runs (pack, unpack, a handle's release, grad_fn pre-hooks) are marked for
# Dynamo's frame evaluator to skip, with every frame they call (``keep_dynamo_out``): no
# wrapper, no cost in eager mode. Under ``fullgraph=True`` a hook refuses at trace time with a
# TBAError that names the per-block recipe (``note_traced_hook``). Marking functions by hand
# instead of ``torch.compiler.disable`` keeps ``import torch._dynamo`` (over a second) out of
# configuring a cache that is never compiled. Checked against torch 2.13; where these Dynamo
# internals are missing, tba's hooks are traced like any user code.
# Tested by tests/cache/test_compile.py.

FULLGRAPH_MESSAGE = (
    "tba: torch.compile(..., fullgraph=True) cannot trace tba's module hooks, which must run "
    "outside the compiled graphs at each block boundary (pytorch#148222: a compiled graph's "
    "saved tensors are packed only when it returns). Compile with tba's backend, which "
    "offloads inside the compiled graph: 'torch.compile(model, backend=\"tba\", "
    "fullgraph=True)'; or compile each block and configure tba afterwards, so tba's hooks sit "
    "on the compiled wrappers and run outside them: 'for i, block in "
    "enumerate(model.blocks): model.blocks[i] = torch.compile(block, fullgraph=True)', then "
    "'tba.configure_tensor_cache(model, ...)' (docs/integrations.md, torch.compile); or "
    "compile without fullgraph=True (tba then breaks the graph at each block)"
)


def is_compiling() -> bool:
    """True while Dynamo traces the calling code (a constant inside a compiled graph)."""
    return torch.compiler.is_compiling()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def call_outside_compile(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``fn(*args, **kwargs)``; Dynamo does not trace this call (it breaks the graph and runs
    it eagerly) nor, with ``keep_dynamo_out``, any frame below it."""
    return fn(*args, **kwargs)


setattr(call_outside_compile, "_torchdynamo_disable", True)  # markers Dynamo reads
setattr(call_outside_compile, "_torchdynamo_disable_msg", FULLGRAPH_MESSAGE)

_refusal_class: type | None = None
num_traced_hooks = 0  # tba hooks Dynamo traced, process-wide (Note [tba under torch.compile])


def _at_trace_time(ctx: object) -> None:
    """Run by Dynamo at trace time (``comptime``): count, and raise under ``fullgraph=True``."""
    global _refusal_class, num_traced_hooks
    num_traced_hooks += 1
    tx = getattr(ctx, "_ComptimeContext__tx", None)
    if tx is None or not getattr(tx, "one_graph", False):
        return
    if _refusal_class is None:
        from torch._dynamo.exc import Unsupported

        from tba.errors import TBAError

        # A TBAError for the user, an Unsupported for Dynamo (which lets it through as is
        # under fullgraph=True instead of wrapping it as an internal error).
        _refusal_class = type("TBACompileError", (TBAError, Unsupported), {"__module__": "tba"})
    raise _refusal_class(FULLGRAPH_MESSAGE)


def note_traced_hook() -> None:
    """Called only while Dynamo traces a tba hook (``is_compiling()``): counts it in
    ``num_traced_hooks`` and, under ``fullgraph=True``, raises a TBAError at trace time, i.e.
    at the first forward."""
    from torch._dynamo.comptime import comptime  # loaded: Dynamo is tracing

    comptime(_at_trace_time)


#: Set on tba's torch.compile backend (tba.compile.backend); ``tracing_for_tba`` looks for it.
TBA_BACKEND_ATTR = "_tba_backend"


def tracing_for_tba() -> bool:
    """Called only while Dynamo traces (``is_compiling()``): whether the graph being traced
    goes to tba's backend (``torch.compile(..., backend="tba")``), which does the work of
    tba's module hooks with ops inside the graph (tba/compile). Dynamo calls this at trace
    time and uses its answer as a constant (the ``_dynamo_marked_constant`` marker that
    ``torch._dynamo.assume_constant_result`` sets); the compiled code is tied to its backend
    (Dynamo's backend-match guard), so the answer cannot go stale. Walks the chain of wrappers
    Dynamo and ``torch.compile`` put around the backend (checked against torch 2.13)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return False
    return is_tba_backend(getattr(getattr(tx, "output", None), "compiler_fn", None))


setattr(tracing_for_tba, "_dynamo_marked_constant", True)


_COMPILE_WRAPPER_FILE = os.path.join("_dynamo", "eval_frame.py")
_COMPILE_WRAPPERS = ("compile_wrapper", "_fn")  # its name in torch 2.13, in older releases


def running_for_tba() -> bool:
    """Whether the caller (a module hook running eagerly) runs inside a call of a module
    compiled with tba's backend. Dynamo does not trace ``torch.nn.Module._call_impl`` (a file
    on its skip list), so the configured model's own forward hooks run eagerly around its
    compiled forward, inside ``torch.compile``'s ``compile_wrapper``; under tba's backend the
    graph does their work. The backend is found in that wrapper's frame (its ``callback``),
    a few frames up (Dynamo's frame callback itself reads None inside a hook frame that
    ``keep_dynamo_out`` marked). Checked against torch 2.13."""
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in _COMPILE_WRAPPERS and code.co_filename.endswith(_COMPILE_WRAPPER_FILE):
            return is_tba_backend(frame.f_locals.get("callback"))
    return False


def is_tba_backend(fn: object) -> bool:
    """Whether ``fn`` is tba's backend or one of the wrappers Dynamo and ``torch.compile`` put
    around a backend (checked against torch 2.13)."""
    for _ in range(16):  # a handful of wrappers at most; never loop on a cycle
        if fn is None:
            return False
        if getattr(fn, TBA_BACKEND_ATTR, False):
            return True
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "__wrapped__", None) or getattr(fn, "func", None))
    return False


def keep_dynamo_out(*functions: Callable[..., object]) -> None:
    """Have Dynamo's frame evaluator skip ``functions`` and every frame they call (they run
    as plain Python even when called from compiled code). Idempotent; no-op on torch builds
    without ``set_code_exec_strategy``."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # pragma: no cover - torch without Dynamo
        return
    setter = getattr(eval_frame, "set_code_exec_strategy", None)
    action = getattr(eval_frame, "_FrameAction", None)
    strategy = getattr(eval_frame, "_FrameExecStrategy", None)
    if setter is None or action is None or strategy is None:
        return
    for fn in functions:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            setter(code, strategy(action.SKIP, action.SKIP))


# ---------------------------------------------------------------------------- backward passes
def graph_task_id() -> int:
    """The id of the autograd graph task (backward pass) running on this thread, or -1."""
    return torch._C._current_graph_task_id()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the backward pass running on this thread ends (autograd's
    final callbacks: after its last node ran, before ``backward()`` returns; an exception it
    raises is raised by ``backward()``). Call only from inside a backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ---------------------------------------------------------------------------- saved-tensor hooks
# A saved-tensor hook pair: pack returns whatever its hook keeps (arbitrary), unpack takes that
# back to a tensor.
PackHook = Callable[[torch.Tensor], Any]
UnpackHook = Callable[[Any], torch.Tensor]


def top_saved_tensors_hooks() -> tuple[PackHook, UnpackHook] | None:
    """The (pack, unpack) pair autograd calls for a tensor saved now on this thread: the top
    of the thread's stack of default saved-tensor hooks (``saved_tensors_hooks`` contexts),
    or None when the stack is empty (Note [Outer saved-tensor hooks] in
    tba/cache/capture/hook_stack.py)."""
    # torch's stub omits the None it returns when the stack is empty.
    top: tuple[PackHook, UnpackHook] | None = (
        torch._C._autograd._top_saved_tensors_default_hooks(False))
    return top


# Note [register_hooks on a saved tensor]: ``grad_fn._raw_saved_<name>`` is a
# ``torch._C._autograd.SavedTensor``; its ``register_hooks(pack, unpack)`` sets a hook pair on
# that one saved tensor and raises a RuntimeError that names neither tba nor a fix when the
# tensor already has a pair, which it does whenever it was saved while default hooks (tba's)
# were active. While a tensor cache exists (the first cache wraps the method, the last one to
# close or be collected puts the original back; importing tba changes nothing) tba turns that
# error into a TBAError when tba's own hooks packed the tensor. Checked against torch 2.13.
_saved_tensor_register_hooks: Callable[..., None] | None = None  # the original while wrapped


def wrap_saved_tensor_register_hooks(
        translate: Callable[[RuntimeError], BaseException | None]) -> None:
    """Replace ``SavedTensor.register_hooks`` by a wrapper that calls the original and, on a
    RuntimeError, raises ``translate(error)`` instead when that returns an exception. Idempotent."""
    global _saved_tensor_register_hooks
    cls = torch._C._autograd.SavedTensor
    if _saved_tensor_register_hooks is not None:
        return
    # torch's stub of SavedTensor omits register_hooks (a method of the C++ class).
    original: Callable[..., None] = cls.register_hooks  # type: ignore[attr-defined]

    def register_hooks(self: torch._C._autograd.SavedTensor, *args: Any, **kwargs: Any) -> None:
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as error:
            better = translate(error)
            if better is None:
                raise
            raise better from error

    register_hooks.__doc__ = original.__doc__
    setattr(register_hooks, "_tba_wrapper", True)  # a marker tests look for
    _saved_tensor_register_hooks = original
    cls.register_hooks = register_hooks  # type: ignore[attr-defined]  # see `original` above


def unwrap_saved_tensor_register_hooks() -> None:
    """Put the original ``SavedTensor.register_hooks`` back. Idempotent."""
    global _saved_tensor_register_hooks
    original, _saved_tensor_register_hooks = _saved_tensor_register_hooks, None
    if original is not None:
        # torch's stub of SavedTensor omits register_hooks (see wrap_... above).
        torch._C._autograd.SavedTensor.register_hooks = original  # type: ignore[attr-defined]
