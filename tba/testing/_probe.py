"""`probe(cache)`: a read-only view of a tensor cache's insides, for tests and extenders.

tba's own tests read the cache through this view and the public API only, so the internals
can change without rewriting them. Everything returned is a copy (frozen dataclasses, lists):
holding it keeps no entry, graph or model alive.

Example:
    >>> view = probe(cache)  # doctest: +SKIP
    >>> view.num_entries, view.counters["resident_bytes"], view.step_open  # doctest: +SKIP
    (0, 0, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tba.cache.observe.stats import CacheStats
    from tba.cache.policy.loop_event import LoopEvent
    from tba.cache.tensor_cache import TensorCache

__all__ = ["probe", "CacheProbe", "EntryView", "RecordView", "ScopeView", "SaveView", "ForwardView"]


@dataclasses.dataclass(frozen=True)
class EntryView:
    """One live entry: a saved storage (of one version-counter family at one version)."""

    state: str  # kept, queued, storing, stored, loading, ready, ...
    nbytes: int
    offloaded: bool  # marked for offload (it has transfer state), whatever happened since
    inline: bool  # stored on the training thread (Note [Small transfers inline])
    num_handles: int  # live handles autograd holds (not yet released)
    unit: str | None  # the unit that saved it first (None: outside every unit)


@dataclasses.dataclass(frozen=True)
class ScopeView:
    unit: str | None
    keep: bool
    num_entries: int


@dataclasses.dataclass(frozen=True)
class RecordView:
    """One forward pass of the running step (Note [Step boundaries])."""

    key: tuple[int, int]
    scopes: tuple[ScopeView, ...]
    forward_done: bool
    backward_started: bool
    backward_done: bool
    num_handles: int
    num_grad_fn_hooks: int


@dataclasses.dataclass(frozen=True)
class ForwardView:
    """The calling thread's forward of the model."""

    depth: int  # nesting of the model's forward calls (0: none running)
    hooks_active: bool  # tba's saved-tensor hooks are entered on this thread
    has_record: bool
    units: tuple[str, ...]  # units running, outermost first
    skip_depth: int


@dataclasses.dataclass(frozen=True)
class SaveView:
    """One tensor autograd handed to tba's pack hook, and what tba did with it."""

    tensor_type: str
    managed: bool  # tba took it (a handle; of a wrapper subclass: inner tensors), or autograd
    new_entry: bool
    offloaded: bool  # the entry is marked for offload
    nbytes: int  # the entry's storage bytes (0 when not managed)
    storage_ptr: int  # the saved tensor's storage address (0 for tensors without storage)
    contiguous: bool
    units: tuple[str, ...]  # units running when it was saved
    skip_depth: int


class CacheProbe:
    """Read-only view of one cache (made by :func:`probe`)."""

    def __init__(self, cache: TensorCache) -> None:
        self._cache = cache

    # ------------------------------------------------------------------ entries
    @property
    def entries(self) -> list[EntryView]:
        """Every live entry (releases queued by dead handles done first)."""
        engine = self._cache._engine
        with engine.lock:
            engine._drain_locked()
            out = []
            for entry in engine.table.entries():
                xfer = entry.xfer
                unit = getattr(entry.scope, "unit", None)
                out.append(EntryView(
                    state=entry.state.value if entry.state is not None else "new",
                    nbytes=entry.nbytes, offloaded=xfer is not None,
                    inline=bool(xfer is not None and xfer.inline),
                    num_handles=entry.num_handles, unit=unit.name if unit is not None else None,
                ))
            return out

    @property
    def num_entries(self) -> int:
        engine = self._cache._engine
        with engine.lock:
            engine._drain_locked()
            return engine.table.num_entries

    @property
    def num_released_pending(self) -> int:
        """Dead handles whose release waits for tba's next entry point."""
        return len(self._cache._engine.released)

    @property
    def counters(self) -> dict[str, int]:
        """The engine's byte counters (resident, in flight, held by the offloader; peaks) and
        the entries dropped while a worker still copies them."""
        engine = self._cache._engine
        with engine.lock:
            engine._drain_locked()
            return {
                "resident_bytes": engine.resident_bytes,
                "inflight_bytes": engine.inflight_bytes,
                "held_bytes": engine.held_bytes,
                "peak_held_bytes": engine.peak_held_bytes,
                "num_orphans": len(engine.orphans),
            }

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until no transfer of the cache is queued or running (bounded): stores,
        loads (also of tensors that died meanwhile) and reserves; releases are done first.

        Raises:
            TBAError: transfers are still running after ``timeout_s`` seconds.
        """
        self._cache._engine.drain()
        self._cache._engine.wait_idle(timeout_s)

    def check_invariants(self) -> list[str]:
        """Note [Cache invariants] now: the broken ones, readable (empty when all hold)."""
        return self._cache._engine.check()

    # ------------------------------------------------------------------ steps
    @property
    def step_open(self) -> bool:
        return self._cache._tracker.open

    @property
    def records(self) -> list[RecordView]:
        """The forwards of the running step, in order."""
        tracker = self._cache._tracker
        with self._cache._engine.lock:
            return [
                RecordView(
                    key=record.key,
                    scopes=tuple(
                        ScopeView(s.unit.name if s.unit is not None else None, s.keep, len(s.entries))
                        for s in record.scopes
                    ),
                    forward_done=record.forward_done, backward_started=record.backward_started,
                    backward_done=record.backward_done, num_handles=record.num_handles,
                    num_grad_fn_hooks=len(record.grad_fn_hooks),
                )
                for record in sorted(tracker.records.values(), key=lambda r: r.seq)
            ]

    @property
    def num_grad_fn_hooks(self) -> int:
        """grad_fn pre-hooks tba holds on live graphs (bounded by the running step)."""
        with self._cache._engine.lock:
            return sum(len(r.grad_fn_hooks) for r in self._cache._tracker.records.values())

    @property
    def num_module_hooks(self) -> int:
        hooks = self._cache._hooks()
        return hooks.num_handles if hooks is not None else 0

    @property
    def history(self) -> list[tuple[int, CacheStats, int]]:
        """(step number, its stats, the boundary it ran at) of the last 1000 steps."""
        with self._cache._engine.lock:
            return list(self._cache._steps.history)

    @property
    def has_closed_loop(self) -> bool:
        """Whether the cache checks its adaptive boundary against measured step time (Note
        [Closed loop]): ``adaptive`` with ``max_step_overhead``, no budget, an offloader."""
        return self._cache._steps.loop is not None

    @property
    def loop_events(self) -> list[LoopEvent]:
        """The closed loop's decisions (measure, pass, fail, settle, suspect, recheck), oldest
        first, the last 256; empty without a closed loop."""
        with self._cache._engine.lock:
            loop = self._cache._steps.loop
            return list(loop.events) if loop is not None else []

    @property
    def forward(self) -> ForwardView:
        state = self._cache._tracker.local
        forward = state.forward
        return ForwardView(
            depth=state.depth, hooks_active=state.ctx is not None,
            has_record=forward.record is not None,
            units=tuple(u[0].name for u in forward.units), skip_depth=forward.skip_depth,
        )

    # ------------------------------------------------------------------ saves
    @property
    def sampling(self) -> bool:
        """Whether forwards still enter the pack hook that samples saves for the "nothing was
        offloaded" warning (Note [Loud when it does nothing]), not the bare one."""
        hooks = self._cache._hooks()
        return hooks is not None and hooks.sampled_pack is not None

    @property
    def saved_tensor_hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """tba's (pack, unpack) pair: what each forward of the model enters, unless the script
        has saved-tensor hooks of its own around the forward (then a chain from them to this
        pair: Note [Outer saved-tensor hooks])."""
        saved = self._cache._saved
        return saved.pack, saved.unpack

    @contextlib.contextmanager
    def watch_saves(
        self, on_save: Callable[[SaveView], None] | None = None
    ) -> Iterator[list[SaveView]]:
        """Record every save of the forwards that begin inside the ``with`` block (what was
        saved and what tba did with it); yields the list it fills. ``on_save`` is called after
        each save, inside the pack hook (a test may wait there, e.g. for the store)."""
        from tba.cache.capture.packed import PackedSubclass
        from tba.cache.engine import Handle

        cache = self._cache
        hooks = cache._hooks()
        assert hooks is not None, "the model of this cache was collected"
        seen: list[SaveView] = []
        forward = cache._tracker.local

        def watching_pack(tensor: torch.Tensor) -> Any:
            before = cache._engine.table.num_entries
            packed = (hooks.sampled_pack or cache._saved.pack)(tensor)
            managed = type(packed) is Handle or type(packed) is PackedSubclass
            entry = packed.entry if type(packed) is Handle else None
            units = tuple(u[0].name for u in forward.forward.units)
            view = SaveView(
                tensor_type=type(tensor).__name__, managed=managed,
                new_entry=managed and cache._engine.table.num_entries > before,
                offloaded=entry is not None and entry.xfer is not None,
                nbytes=entry.nbytes if entry is not None else 0,
                storage_ptr=_storage_ptr(tensor), contiguous=_contiguous(tensor),
                units=units, skip_depth=forward.forward.skip_depth,
            )
            seen.append(view)
            if on_save is not None:
                on_save(view)
            return packed

        from tba import _torch_compat as compat

        compat.keep_dynamo_out(watching_pack)  # Note [tba under torch.compile]
        hooks.watch_pack = watching_pack
        try:
            yield seen
        finally:
            hooks.watch_pack = None


def _storage_ptr(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # subclasses, functorch wrappers, zero tensors
        return 0


def _contiguous(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_contiguous()
    except (NotImplementedError, RuntimeError):
        return False


def probe(cache: TensorCache) -> CacheProbe:
    """A read-only view of ``cache``'s entries, steps, records and hooks (for tests)."""
    from tba.cache.tensor_cache import TensorCache

    if not isinstance(cache, TensorCache):
        raise TypeError(f"probe() expects a tba.TensorCache, got {type(cache).__name__}")
    return CacheProbe(cache)
