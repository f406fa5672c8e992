"""`CacheStats`: what the cache did in one step (or in total)."""

from __future__ import annotations

import dataclasses

from tba.offloaders.tier_stats import TierStats, merge_tiers

__all__ = ["CacheStats", "format_bytes", "format_placement", "format_summary"]


@dataclasses.dataclass
class CacheStats:
    """Counters of one completed step (``TensorCache.stats()``) or of every step so far
    (``TensorCache.stats(cumulative=True)``).

    A step is one or more forwards of the model and the backward passes of their graphs (Note
    [Step boundaries] in tba/cache/steps/tracker.py; with pipeline hints, the whole schedule).

    Attributes:
        num_steps: steps these counters cover.
        num_packed: tensors autograd handed to the cache.
        num_deduplicated: packs that hit a storage already held (no second write).
        num_family_entries: packs of a storage already held under another version-counter
            family (``unsafe_chunk`` siblings, ``.data``, ``detach()`` aliases): given an entry
            of their own and written again, because PyTorch may hand backward different bytes
            for them (Note [Version-counter families]).
        num_offloaded: storages written to the offloader.
        offloaded_bytes: bytes written to the offloader.
        reloaded_bytes: bytes read back from the offloader.
        num_forwarded: unpacks served from memory with no read (kept, or write still in flight).
        num_sync_loads: unpacks that had to start their own load (prefetch missed them).
        num_cancelled: queued stores cancelled because the tensor was needed or died first.
        kept_bytes: bytes of managed storages kept in memory (tail, small, skipped, adaptive).
        peak_resident_bytes: exact bytes of saved activations the cache held in device memory
            at the step's peak.
        stall_s: time backward waited for loads.
        store_wait_s: time forward waited for in-flight stores (``max_inflight_bytes``).
        write_bytes_per_s: offloaded bytes over the time stores took (completed stores only).
        read_bytes_per_s: reloaded bytes over the time loads took.
        num_io_errors: stores or loads that failed (with ``on_io_error="keep"``, kept instead).
        num_resized: stores refused because the saved storage was resized or freed behind
            autograd's back (``storage.resize_``); those tensors stayed in memory.
        num_captured: saves made during CUDA-graph capture, left to autograd.
        num_record_stream: reloaded tensors consumed on a stream other than the one their
            buffer was allocated on (``record_stream`` needed; Note [Reload buffers on the
            consumer's stream]).
        io_cpu_s: CPU seconds the transfers took from the host: the CPU time of the threads
            running the offloader's ``store`` and ``load`` (the workers, or the training thread
            for small inline transfers; reload buffers included), plus what the offloader's
            own I/O threads charged to them (the SSD posix engine's pool). What offloading
            costs the cores that also compute; see :attr:`io_cpu_s_per_gb`.
        pool_growth_s: seconds stores spent growing the offloader's pool (allocating and
            pinning host memory), kept out of ``write_s`` and the write bandwidth (Note [Pool
            growth is not transfer time] in tba/offloaders/cpu_time.py).
        tiers: per tier of a tiered offloader (``"host+ssd"``: ``"host"`` and ``"ssd"``), what
            it stored and held (:class:`tba.offloaders.TierStats`); empty otherwise.
    """

    num_steps: int = 0
    num_packed: int = 0
    num_deduplicated: int = 0
    num_family_entries: int = 0
    num_offloaded: int = 0
    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    num_forwarded: int = 0
    num_sync_loads: int = 0
    num_cancelled: int = 0
    kept_bytes: int = 0
    peak_resident_bytes: int = 0
    stall_s: float = 0.0
    store_wait_s: float = 0.0
    write_bytes_per_s: float = 0.0
    read_bytes_per_s: float = 0.0
    num_io_errors: int = 0
    num_resized: int = 0
    num_captured: int = 0
    num_record_stream: int = 0
    io_cpu_s: float = 0.0
    pool_growth_s: float = 0.0
    # Busy time of completed transfers, the denominators of the two rates above.
    write_s: float = 0.0
    read_s: float = 0.0
    tiers: dict[str, TierStats] = dataclasses.field(default_factory=dict)

    def merged(self, other: CacheStats) -> CacheStats:
        """Totals of two stats (peaks take the maximum, rates are recomputed)."""
        out = CacheStats()
        for field in dataclasses.fields(CacheStats):
            a, b = getattr(self, field.name), getattr(other, field.name)
            if field.name == "tiers":
                out.tiers = merge_tiers(a, b)
            else:
                setattr(out, field.name, max(a, b) if field.name == "peak_resident_bytes" else a + b)
        out.finish_rates()
        return out

    def finish_rates(self) -> None:
        self.write_bytes_per_s = self.offloaded_bytes / self.write_s if self.write_s > 0 else 0.0
        self.read_bytes_per_s = self.reloaded_bytes / self.read_s if self.read_s > 0 else 0.0

    @property
    def io_cpu_s_per_gb(self) -> float:
        """``io_cpu_s`` per GB (1e9 bytes) moved, offloaded and reloaded; 0.0 if none moved."""
        moved = self.offloaded_bytes + self.reloaded_bytes
        return self.io_cpu_s / (moved / 1e9) if moved else 0.0

    def __str__(self) -> str:
        """A readable report (``print(cache.stats())``); ``repr`` keeps every raw field.

        Example:
            >>> print(CacheStats(num_steps=1, num_offloaded=2, offloaded_bytes=3 << 20,
            ...                  write_s=0.003).merged(CacheStats()))  # doctest: +ELLIPSIS
            tba cache, 1 step:
              offloaded      3.0 MiB in 2 stores, write 1.05 GB/s
            ...
        """
        steps = f"{self.num_steps} step" + ("" if self.num_steps == 1 else "s")
        lines = [
            f"tba cache, {steps}:",
            f"  offloaded {format_bytes(self.offloaded_bytes):>12} in {self.num_offloaded} "
            f"stores, write {_rate(self.write_bytes_per_s)}",
            f"  reloaded  {format_bytes(self.reloaded_bytes):>12}, read "
            f"{_rate(self.read_bytes_per_s)}, {self.num_sync_loads} loads not prefetched",
            f"  I/O CPU   {self.io_cpu_s * 1e3:9.1f} ms on transfer threads, "
            f"{self.io_cpu_s_per_gb:.3f} s per GB moved",
            f"  kept      {format_bytes(self.kept_bytes):>12} in memory, peak resident "
            f"{format_bytes(self.peak_resident_bytes)}",
            f"  waits     stall {self.stall_s * 1e3:.1f} ms (backward on loads), store wait "
            f"{self.store_wait_s * 1e3:.1f} ms (forward on max_inflight_bytes)",
            f"  saves     {self.num_packed} packed, {self.num_deduplicated} deduplicated, "
            f"{self.num_family_entries} family entries, {self.num_forwarded} served from "
            f"memory, {self.num_cancelled} stores cancelled",
        ]
        if self.num_io_errors:
            lines.append(f"  I/O errors {self.num_io_errors}")
        for name, tier in self.tiers.items():
            lines.append(
                f"  tier {name:<5} {format_bytes(tier.stored_bytes):>10} in {tier.num_stored} stores, "
                f"peak held {format_bytes(tier.peak_held_bytes)}"
                + ("" if tier.budget_bytes is None else f" of budget {format_bytes(tier.budget_bytes)}")
            )
        return "\n".join(lines)


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s > 0 else "n/a (nothing timed)"


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB, TiB).

    Example:
        >>> format_bytes(512), format_bytes(3 << 20), format_bytes(1536)
        ('512 B', '3.0 MiB', '1.5 KiB')
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def format_summary(
    rows: list[tuple[int, CacheStats, int]],
    num_blocks: int,
    decision: object,
    note: str | None = None,
    tiers: dict[str, TierStats] | None = None,
) -> str:
    """The table behind ``TensorCache.summary()``: one line per (step number, stats, number of
    blocks the policy offloaded), then the adaptive decision and ``note`` (why nothing was
    offloaded) if any, and where a tiered offloader put tensors over all steps (``tiers``). A
    step that wrote nothing shows "none" in the blocks column, whatever
    the policy was."""
    mib = 2**20
    header = (
        f"{'step':>5} {'offloaded MiB':>13} {'reloaded MiB':>12} {'kept MiB':>9} {'fwd':>5} "
        f"{'dedup':>5} {'write GB/s':>10} {'read GB/s':>9} {'stall ms':>8} {'peak MiB':>9} "
        f"{'I/O CPU ms':>10} {'offloaded blocks':>16}"
    )
    lines = [header, "-" * len(header)]
    for number, s, tail_start in rows:
        if not (tail_start and s.offloaded_bytes):
            blocks = f"none of {num_blocks}"
        else:  # "0 of 6" (the first block alone), "0-4 of 6" (blocks 0 to 4)
            blocks = f"{'0' if tail_start == 1 else f'0-{tail_start - 1}'} of {num_blocks}"
        lines.append(
            f"{number:>5} {s.offloaded_bytes / mib:>13.1f} {s.reloaded_bytes / mib:>12.1f} "
            f"{s.kept_bytes / mib:>9.1f} {s.num_forwarded:>5} {s.num_deduplicated:>5} "
            f"{s.write_bytes_per_s / 1e9:>10.2f} {s.read_bytes_per_s / 1e9:>9.2f} "
            f"{s.stall_s * 1e3:>8.1f} {s.peak_resident_bytes / mib:>9.1f} {s.io_cpu_s * 1e3:>10.1f} "
            f"{blocks:>16}"
        )
    if not rows:
        lines.append("(no completed step yet)")
    if decision is not None:
        lines.append(f"adaptive: {decision}")
    placement = format_placement(tiers or {})
    if placement is not None:
        lines.append(placement)
    if note is not None:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def format_placement(tiers: dict[str, TierStats]) -> str | None:
    """One line saying where a tiered offloader put tensors and why (None without tiers): the
    first tier, its peak against its budget, and what spilled to the next ones.

    Example:
        >>> print(format_placement({
        ...     "host": TierStats(num_stored=3, stored_bytes=3 << 20, peak_held_bytes=2 << 20,
        ...                       budget_bytes=2 << 20, num_over_budget=1),
        ...     "ssd": TierStats(num_stored=1, stored_bytes=1 << 20, peak_held_bytes=1 << 20)}))
        placement: host held up to 2.0 MiB of its 2.0 MiB budget (3 tensors, 3.0 MiB stored); 1.0 MiB in 1 tensor spilled to ssd because the host tier was full (1 would have taken it past its budget)
    """
    if not tiers:
        return None
    names = list(tiers)
    first, rest = tiers[names[0]], names[1:]
    budget = "" if first.budget_bytes is None else f" of its {format_bytes(first.budget_bytes)} budget"
    line = (
        f"placement: {names[0]} held up to {format_bytes(first.peak_held_bytes)}{budget} "
        f"({_tensors(first.num_stored)}, {format_bytes(first.stored_bytes)} stored)"
    )
    spilled = [(name, tiers[name]) for name in rest if tiers[name].num_stored]
    if not spilled:
        return line + "; nothing spilled" + (f" to {', '.join(rest)}" if rest else "")
    reasons = []
    if first.num_over_budget:
        reasons.append(f"{first.num_over_budget} would have taken it past its budget")
    if first.num_no_room:
        reasons.append(f"{first.num_no_room} found no contiguous room in its pool within the budget")
    parts = [f"{format_bytes(s.stored_bytes)} in {_tensors(s.num_stored)} spilled to {name}" for name, s in spilled]
    return f"{line}; {', '.join(parts)} because the {names[0]} tier was full ({'; '.join(reasons)})"


def _tensors(count: int) -> str:
    return f"{count} tensor" + ("" if count == 1 else "s")
