"""`TensorCache`: the public face of the cache (stats, summary, stage hints, close).

The work is split by owner: ``hooks`` (module and saved-tensor hooks, per-thread forward
state), ``table`` (identity, reference counts, release), ``transfers`` (the entry state
machine, workers, their lock, counters and trace), ``steps`` (step boundaries, history and the
adaptive cycle). Lock order: hooks -> table -> transfers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from tba import _env
from tba.cache.diagnose import NoOffloadDiagnosis
from tba.cache.entries import State
from tba.cache.hooks import CacheHooks
from tba.cache.policy import Boundary, BoundaryDecision
from tba.cache.scopes import Unit, find_units
from tba.cache.stages import StageHint
from tba.cache.stats import CacheStats, format_summary
from tba.cache.steps import Steps
from tba.cache.streams import DeviceStreams, StreamLayer
from tba.cache.table import EntryTable
from tba.cache.trace import TraceRecorder
from tba.cache.transfers import Transfers
from tba.config import TensorCacheConfig
from tba.errors import TBAError
from tba.offloaders.base import Offloader
from tba.offloaders.tier_stats import take_tier_stats

__all__ = ["TensorCache", "StageHint"]

logger = logging.getLogger(__name__)


def _on_cuda(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"


def _store_wait_s(engine: Transfers) -> float:
    return engine.step.store_wait_s


def _shutdown(engine: Transfers, offloader: Offloader | None) -> None:
    """Stop the workers and release the offloader of a cache that was closed or collected."""
    engine.close([])
    if offloader is not None:
        offloader.close()


class TensorCache:
    """Offloads the activations a model saves for backward and brings them back in time.

    Made by :func:`tba.configure_tensor_cache`; see there for an example. The cache enters
    ``saved_tensors_hooks`` around each forward of the model itself and finds step boundaries
    itself; errors from its I/O threads are raised on the training thread.

    A cache dropped without ``close()`` is collected with its model (worker threads stopped,
    offloader closed); a copy of the model (``copy.deepcopy``, ``torch.save``) is not
    configured.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TensorCacheConfig,
        offloader: Offloader | None,
        *,
        streams: StreamLayer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.offloader = offloader
        self._engine = Transfers(
            offloader,
            streams if streams is not None else DeviceStreams(),
            num_store_threads=config.num_store_threads,
            num_load_threads=config.num_load_threads,
            max_inflight_bytes=config.max_inflight_bytes,
            on_io_error=config.on_io_error,
            trace=TraceRecorder(),
        )
        self.units: list[Unit] = find_units(model, config.block_modules)
        self.num_blocks = sum(u.block_index is not None for u in self.units)
        if self.num_blocks == 0:
            # No repeated blocks: the root's children take their place in forward order.
            for index, unit in enumerate(self.units):
                unit.block_index = index
            self.num_blocks = len(self.units)
        self.boundary = Boundary(self.num_blocks, config.keep_last_modules)
        self._steps = Steps(
            config, self.boundary, offloader, functools.partial(_on_cuda, model),
            functools.partial(_store_wait_s, self._engine), self._engine.reserve_later,
        )
        engine = self._engine
        self._table = EntryTable(
            config.min_offload_bytes, engine.drop, self._on_empty_weak(),
            engine_busy=lambda: engine.lock._is_owned(),  # Note [Releases from the collector]
        )
        # Live graphs hold the hooks (autograd keeps the unpack hook with every saved
        # tensor): the hooks hold the cache only weakly, so a graph never keeps it alive.
        self._hooks = CacheHooks(
            model, config, self.units, self._table, self._engine, self._steps, self.boundary,
            weakref.WeakMethod(self._finish_step),
        )
        # What set_stage saw, in order (bounded): the integrations' tests compare it with the
        # schedule's own order.
        self.stage_log: collections.deque[tuple[int, int | None, str]] = collections.deque(
            maxlen=1 << 16
        )
        # Note [Loud when it does nothing]
        self._diagnosis = NoOffloadDiagnosis(config, self.boundary, offloader is not None)
        if self._diagnosis.sampling:
            self._hooks.sampled_pack = self._diagnosis.wrap(
                lambda tensor, hooks=self._hooks: hooks._pack(tensor)
            )
            self._hooks.on_forward_skipped = self._diagnosis.forward_skipped
        self._check = _env.check_invariants()
        self._stats_lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._engine, offloader)
        self._hooks.install()

    # ------------------------------------------------------------------ public API
    def stats(self, cumulative: bool = False) -> CacheStats:
        """Counters of the last completed step, or totals over all steps with ``cumulative``."""
        self._table.drain_if_safe()
        self._raise_violation()
        with self._stats_lock:
            out = dataclasses.replace(self._steps.total if cumulative else self._steps.last)
            out.tiers = {name: dataclasses.replace(tier) for name, tier in out.tiers.items()}
            return out

    @property
    def adaptive_decision(self) -> BoundaryDecision | None:
        """The last decision of the adaptive policy or of budget mode: which blocks are
        offloaded, the measurements it came from (the profile; the closed loop's keep and
        offload step times and overhead; the budget's measured and estimated peaks) and the
        reason, or None before the profiled step (docs/policy.md)."""
        return self.boundary.decision

    def summary(self, last: int = 20) -> str:
        """A readable table of the last ``last`` steps: bytes offloaded, forwarded,
        deduplicated and kept, GB/s, stall, peak resident, and which blocks were offloaded,
        followed by the last decision (``adaptive_decision``) with its measurements and reason."""
        self._table.drain_if_safe()
        with self._stats_lock:
            rows = list(self._steps.history)[-last:]
            tiers = self._steps.total.tiers
        return format_summary(rows, self.num_blocks, self.boundary.decision,
                              self._diagnosis.warning, tiers)

    def export_trace(self, path: str) -> int:
        """Write the last completed step's store, load and stall events as Chrome-trace JSON
        (open it in Perfetto or chrome://tracing); returns the number of events."""
        return self._engine.trace.export(path)

    def wait_for_stores(self, timeout_s: float = 60.0) -> None:
        """Block until every queued or running store has finished (for tests and debugging:
        a backward that follows sees every offloaded tensor really read back).

        Raises:
            TBAError: stores are still in flight after ``timeout_s`` seconds.
            OffloadIOError: a store failed (with ``on_io_error="raise"``).
        """
        self._table.drain_if_safe()
        self._engine.wait_for_stores(timeout_s)

    def set_stage(
        self,
        *,
        microbatch: int | None,
        action: str,
        stage: int = 0,
        next_microbatch: int | None = None,
        next_action: str | None = None,
        next_stage: int | None = None,
    ) -> None:
        """Tell the cache what runs now and what comes next (called by pipeline integrations).

        Args:
            microbatch: index of the microbatch about to run.
            action: ``"forward"``, ``"backward"``, ``"input_grad"`` or ``"weight_grad"``.
            stage: pipeline stage index (several stages may share a rank).
            next_microbatch, next_action, next_stage: the action that follows, if known.

        A forward opens a record for (stage, microbatch); its last blocks stay in memory only
        when its own backward comes next. A backward prefetches that record's tensors, last
        blocks first; a known next backward is prefetched while the current action runs.
        """
        hint = StageHint(stage, microbatch, action, next_stage, next_microbatch, next_action)
        self.stage_log.append((stage, microbatch, action))
        self._hooks.set_stage(hint)

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the cache is closed (``configure_tensor_cache`` unregisters
        the cache from the integrations' registry this way)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Remove every hook tba installed and drop everything it holds. Idempotent.

        Call it after the last backward: a graph built with the cache and not yet run
        backward cannot reach offloaded tensors once the cache is closed.

        Raises:
            TBAError: with ``TBA_CHECK_INVARIANTS=1``, a step broke an invariant.
        """
        if self._closed:
            return
        self._closed = True
        self._hooks.remove()
        entries = self._table.close()
        self._engine.close(entries)
        self._finalizer()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
        if self._engine.dead is None:  # a dead worker was raised in the steps already
            self._raise_violation()

    def __enter__(self) -> TensorCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        """What the cache did, not what it would do: ``offloaded_blocks`` counts the blocks the
        policy offloaded in the last completed step, 0 when that step wrote nothing."""
        name = self.offloader.name if self.offloader is not None else "none"
        last, steps = self._steps.last, self._steps.total.num_steps
        history = self._steps.history
        ran_at = history[-1][2] if history else self.boundary.tail_start
        offloaded = ran_at if last.offloaded_bytes > 0 else 0
        return (
            f"TensorCache(model={type(self.model).__name__}, offloader={name!r}, "
            f"blocks={self.num_blocks}, steps={steps}, offloaded_blocks={offloaded}, "
            f"offloaded_bytes={last.offloaded_bytes} (last step), closed={self._closed})"
        )

    # ------------------------------------------------------------------ steps
    def _on_empty_weak(self) -> Callable[[], None]:
        ref = weakref.ref(self)

        def on_empty() -> None:
            cache = ref()
            if cache is not None:
                cache._hooks.on_empty()

        return on_empty

    def _finish_step(self) -> None:
        """Close the running step (hooks lock held)."""
        engine, table = self._engine, self._table
        step = engine.take_step()
        step.num_packed, step.num_deduplicated, step.num_family_entries = table.take_counts()
        hooks = self._hooks
        step.num_captured, hooks.num_captured = hooks.num_captured, 0
        step.num_record_stream, hooks.num_record_stream = hooks.num_record_stream, 0
        step.tiers = take_tier_stats(self.offloader)
        with self._stats_lock:
            self._steps.finish(step, engine.peak_held_bytes)
        diagnosis = self._diagnosis
        if diagnosis.warning is None:
            diagnosis.step_finished(step, self._steps.total.num_steps)
            if not diagnosis.sampling:
                self._hooks.sampled_pack = None
        engine.trace.end_step()
        self._hooks.step_finished()
        self._hooks.note_compile()
        if self._check:
            self._check_invariants()

    def _check_invariants(self) -> None:
        """Note [Cache invariants]: after a completed step the counters equal what the live
        entries hold (none when backward released everything: nothing in flight, nothing
        resident, nothing held by the offloader)."""
        entries = self._table.entries()
        offloader = self.offloader
        problems = self._engine.check(entries)
        if (
            offloader is not None
            and not self._engine.transfers_of_dropped_running
            and not any(e.token is not None or e.state is State.STORING for e in entries)
        ):
            used = getattr(offloader, "used_bytes", None)
            if isinstance(used, int) and used != 0:
                problems.append(
                    f"no entry holds offloaded data but the {offloader.name!r} offloader still "
                    f"holds {used} bytes (an allocation was not returned)"
                )
        if problems:
            violation = TBAError(
                "tba invariant violated after step "
                f"{self._steps.total.num_steps}: " + "; ".join(problems)
            )
            logger.error("%s", violation)
            self._engine.set_error(violation)  # raised in the training step

    def _raise_violation(self) -> None:
        self._engine.raise_pending()


    # ------------------------------------------------------------------ for tests
    @property
    def _transfers(self) -> Transfers:
        return self._engine
