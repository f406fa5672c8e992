"""`TensorCache`: the public face of the cache (stats, summary, stage hints, close).

The work is split by owner: ``engine`` (Note [One owner of entry life]: entries, their states,
transfers, counters, under one lock), ``tracker`` (records of the running step, step
boundaries, prefetch: Note [Step boundaries]), ``saving`` (the pack and unpack hooks),
``hooks`` (the module hooks), ``steps`` (finished steps' stats and the adaptive cycle).

Note [The model owns its cache]: ``configure_tensor_cache(model)`` works the same whether or
not its result is kept. The model's module hooks hold the cache strongly; the cache holds the
model and its hooks only weakly, and nothing autograd keeps (the hook pair of every saved
tensor, handles, grad_fn pre-hooks, the end-of-backward callback) reaches the cache or the
model: they refer to the engine and the tracker only. Worker threads refer to the engine and
drop each job's locals when it is done. So the cache lives exactly as long as the model (or the
user's handle, if longer): when the model is collected its hooks go, the cache is collected,
and its finaliser stops the workers and closes the offloader (removing the SSD directory). A
graph still alive then raises a TBAError at its next unpack. ``close()`` and configuring the
model again end a cache the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable
from typing import cast

from torch import nn

from tba import _env
from tba.cache.capture import hook_stack
from tba.cache.capture.compiled import CompiledForwards
from tba.cache.capture.hooks import CacheHooks
from tba.cache.capture.run_order import RunOrder
from tba.cache.capture.saving import SavedTensors
from tba.cache.engine import Engine
from tba.cache.engine.entries import SavedRecord
from tba.cache.engine.streams import DeviceStreams, StreamLayer
from tba.cache.observe.stats import CacheStats, format_summary
from tba.cache.observe.trace import TraceRecorder
from tba.cache.policy.boundary import Boundary, BoundaryDecision
from tba.cache.policy.diagnose import NoOffloadDiagnosis
from tba.cache.steps.scopes import Unit, find_units
from tba.cache.steps.stages import StageHint
from tba.cache.steps.steps import Steps
from tba.cache.steps.tracker import StepTracker
from tba.config import TensorCacheConfig
from tba.errors import TBAError
from tba.offloaders.base import Offloader
from tba.offloaders.tier_stats import take_tier_stats

__all__ = ["TensorCache", "StageHint"]

logger = logging.getLogger(__name__)


def _on_cuda(model_ref: weakref.ref[nn.Module]) -> bool:
    model = model_ref()
    param = next(model.parameters(), None) if model is not None else None
    return param is not None and param.device.type == "cuda"


def _store_wait_s(engine: Engine) -> float:
    return engine.step.store_wait_s


def _shutdown(engine: Engine, tracker: StepTracker, saved: SavedTensors, offloader: Offloader | None) -> None:
    """Stop the workers and release the offloader of a cache that was closed or collected."""
    saved.closed = True
    hook_stack.detach()  # Note [register_hooks on a saved tensor]
    with engine.lock:
        tracker.close()
    engine.close()
    if offloader is not None:
        offloader.close()


class TensorCache:
    """Offloads the activations a model saves for backward and brings them back in time.

    Made by :func:`tba.configure_tensor_cache`; see there for an example. The cache enters
    ``saved_tensors_hooks`` around each forward of the model itself and finds step boundaries
    itself; errors from its I/O threads are raised on the training thread.

    The model owns its cache (Note [The model owns its cache]): keeping the result of
    ``configure_tensor_cache`` is optional (``tba.get_tensor_cache(model)`` finds it again),
    and the cache is closed with ``close()``, by configuring the model again, or when the model
    is collected. A copy of the model (``copy.deepcopy``, ``torch.save``) is not configured.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TensorCacheConfig,
        offloader: Offloader | None,
        *,
        streams: StreamLayer | None = None,
    ) -> None:
        self._model = weakref.ref(model)
        self.config = config
        self.offloader = offloader
        # Before the engine: a refused block_modules leaves no engine (its lock is guarded
        # against SIGINT until it is closed) behind.
        self.units: list[Unit] = find_units(model, config.block_modules)
        engine = self._engine = Engine(
            offloader,
            streams if streams is not None else DeviceStreams(),
            num_store_threads=config.num_store_threads,
            num_load_threads=config.num_load_threads,
            max_inflight_bytes=config.max_inflight_bytes,
            min_offload_bytes=config.min_offload_bytes,
            on_io_error=config.on_io_error,
            timeout_s=config.transfer_timeout_s,
            trace=TraceRecorder(),
        )
        self.num_blocks = sum(u.block_index is not None for u in self.units)
        blocks_note = None
        if self.num_blocks == 0:
            # No repeated blocks: the root's children take their place (in the order they
            # run: Note [Blocks in run order]); a model without children is its one block.
            if not self.units:
                self.units = [Unit(model, "", 0)]
                blocks_note = (
                    f"{type(model).__name__} has no submodules, so its whole forward is one "
                    "block (give the model submodules for its stages and name them with "
                    "block_modules= to offload all but the last ones, or pass "
                    "keep_last_modules=0 to offload every save of its forward)"
                )
            else:
                blocks_note = (
                    f"no repeated blocks were found in {type(model).__name__} (no "
                    f"nn.ModuleList of blocks), so its {len(self.units)} child modules are the "
                    "blocks (name finer blocks with block_modules=, e.g. "
                    "block_modules=(MyBlock,) or block_modules=('encoder.layer*',), or lower "
                    "keep_last_modules)"
                )
            for index, unit in enumerate(self.units):
                unit.block_index = index
            self.num_blocks = len(self.units)
        self._run_order = RunOrder(self.units)
        self.boundary = Boundary(self.num_blocks, config.keep_last_modules)
        self._steps = Steps(
            config, self.boundary, offloader, functools.partial(_on_cuda, self._model),
            functools.partial(_store_wait_s, engine), engine.reserve_later,
        )
        self._tracker = tracker = StepTracker(
            engine.lock, engine._drain_locked, engine.raise_pending, self.boundary, config.prefetch_modules,
            engine.prefetch if offloader is not None else None, self._weak_finish_step(),
        )
        tracker.on_forward_abandoned = self._steps.forward_abandoned
        # The engine hands back the tracker's own records, typed as the ``SavedRecord`` it knows
        # (it does not import the capture side): this is where the two types meet.
        engine.on_records_dead = cast("Callable[[list[SavedRecord]], None]", tracker.records_dead)
        self._saved = SavedTensors(
            engine, tracker, self._steps, frozenset(config.offload_devices), offloader is not None,
            config.min_offload_bytes,
        )
        # What set_stage saw, in order (bounded): the integrations' tests compare it with the
        # schedule's own order.
        self.stage_log: collections.deque[tuple[int, int | None, str]] = collections.deque(
            maxlen=1 << 16
        )
        self._check = _env.check_invariants()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._compiled: CompiledForwards | None = None
        hook_stack.attach()  # undone by _shutdown
        self._finalizer = weakref.finalize(self, _shutdown, engine, tracker, self._saved, offloader)
        hooks = CacheHooks(self, model, config, self.units, engine, tracker, self._saved,
                           self._steps, self._run_order)
        self._hooks = weakref.ref(hooks)  # the model holds them (and through them, this cache)
        # Note [Loud when it does nothing]
        self._diagnosis = NoOffloadDiagnosis(config, self.boundary, offloader is not None,
                                             blocks_note)
        if self._diagnosis.sampling:
            hooks.sampled_pack = self._diagnosis.wrap(self._saved.pack)
            hooks.on_forward_skipped = self._diagnosis.forward_skipped
            hooks.on_outer_passed = self._diagnosis.outer_passed

    # ------------------------------------------------------------------ public API
    @property
    def model(self) -> nn.Module | None:
        """The configured model (None once it was collected)."""
        return self._model()

    def stats(self, cumulative: bool = False) -> CacheStats:
        """Counters of the last completed step, or totals over all steps with ``cumulative``."""
        with self._engine.lock:
            self._engine._drain_locked()
            steps = self._steps
            out = dataclasses.replace(steps.total if cumulative else steps.last)
            out.tiers = {name: dataclasses.replace(tier) for name, tier in out.tiers.items()}
        self._raise_pending()
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
        with self._engine.lock:
            self._engine._drain_locked()
            rows = list(self._steps.history)[-last:]
            tiers = self._steps.total.tiers
        self._raise_pending()
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
        self._engine.wait_for_stores(timeout_s)
        self._raise_pending()

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
        with self._engine.lock:
            self._tracker.set_stage(hint)
        self._raise_pending()

    def _compiled_forwards(self) -> CompiledForwards:
        """The cache's side of graphs compiled with ``backend="tba"`` (for tba.compile; Note
        [The cache under compiled graphs] in tba/cache/capture/compiled.py)."""
        if self._compiled is None:
            self._compiled = CompiledForwards(self._hooks, self._model, self._saved, self.config,
                                              self.units)
        return self._compiled

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the cache is closed (``configure_tensor_cache`` unregisters
        the cache from the integrations' registry this way)."""
        self._on_close.append(callback)

    @property
    def closed(self) -> bool:
        return self._closed

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
        hooks = self._hooks()
        with self._engine.lock:
            if hooks is not None:
                hooks.remove()
        self._finalizer()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
        if self._engine.dead is None:  # a dead worker was raised in the steps already
            self._raise_pending()

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
        model = self.model
        return (
            f"TensorCache(model={type(model).__name__ if model is not None else None}, "
            f"offloader={name!r}, blocks={self.num_blocks}, steps={steps}, "
            f"offloaded_blocks={offloaded}, offloaded_bytes={last.offloaded_bytes} (last step), "
            f"closed={self._closed})"
        )

    # ------------------------------------------------------------------ steps
    def _weak_finish_step(self) -> Callable[[bool], None]:
        ref = weakref.WeakMethod(self._finish_step)

        def on_step_end(interrupted: bool) -> None:
            finish = ref()
            if finish is not None:
                finish(interrupted)

        return on_step_end

    def _finish_step(self, interrupted: bool) -> None:
        """Close the running step (engine lock held: the tracker decided it ended), or drop it
        when every forward of it was ``interrupted`` (Note [Step boundaries])."""
        engine, saved = self._engine, self._saved
        step = engine.take_step()
        step.num_captured, saved.num_captured = saved.num_captured, 0
        step.num_record_stream, saved.num_record_stream = saved.num_record_stream, 0
        step.tiers = take_tier_stats(self.offloader)
        if interrupted:
            self._steps.drop(step)
            self._diagnosis.step_dropped()
            if self._check:
                self._check_invariants()
            return
        self._steps.finish(step, engine.peak_held_bytes)
        hooks = self._hooks()
        diagnosis = self._diagnosis
        if diagnosis.warning is None:
            diagnosis.step_finished(step, self._steps.total.num_steps,
                                    self._run_order.take_renumbered())
            if not diagnosis.sampling and hooks is not None:
                hooks.sampled_pack = hooks.on_outer_passed = None
        engine.trace.end_step()
        if hooks is not None:
            hooks.note_compile()
        if self._check:
            self._check_invariants()

    def _check_invariants(self) -> None:
        """Note [Cache invariants]: after a completed step the counters equal what the live
        entries hold, and the offloader holds nothing when no entry holds offloaded data."""
        engine, offloader = self._engine, self.offloader
        problems = engine.check()
        if offloader is not None and not engine.holds_offloaded_data():
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
            engine.set_error(violation)  # raised in the training step

    def _raise_pending(self) -> None:
        from tba.cache.engine import interrupts

        if interrupts.pending:
            interrupts.raise_pending()
        self._engine.raise_pending()
