"""tba's tuning constants, in one place, each with its unit and why it has its value.

These are not configuration: what a user chooses is a `tba.TensorCacheConfig` field
(docs/options.md). These are the values tba's own code is tuned with; docs/settings.md lists
them in a table. Change one here, never a copy of it elsewhere (each module imports what it
uses from this module; tests/test_settings.py checks that the page lists every one).

Sizes are bytes, times seconds, ratios plain factors.
"""

from __future__ import annotations

import mmap

__all__ = [
    "BANDWIDTH_DRIFT",
    "CHECKSUM_BLOCK_BYTES",
    "CLOSED_LOOP_BASELINE_KEEPS",
    "CLOSED_LOOP_CONFIDENCE",
    "CLOSED_LOOP_DISTURBED",
    "CLOSED_LOOP_DRIFT_WINDOW",
    "CLOSED_LOOP_MAX_DISTURBED",
    "CLOSED_LOOP_KEEP_EVERY",
    "CLOSED_LOOP_KEEP_MARGIN",
    "CLOSED_LOOP_MAX_PAIRS",
    "CLOSED_LOOP_MAX_PROBE_STEPS",
    "CLOSED_LOOP_MIN_PAIRS",
    "CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD",
    "CLOSED_LOOP_PASS_CONFIDENCE",
    "CLOSED_LOOP_RECHECK_EVERY_STEPS",
    "CLOSED_LOOP_RUN",
    "DIRECT_IO_ALIGNMENT",
    "HOST_POOL_ALIGNMENT",
    "HOST_POOL_MIN_SLAB_BYTES",
    "INLINE_MAX_BYTES",
    "MAX_TRACE_EVENTS_PER_STEP",
    "PAGE_BYTES",
    "POLL_S",
    "REGISTRATION_SHORTFALL_MIN_RESERVED_BYTES",
    "REGISTRATION_SHORTFALL_RATIO",
    "SSD_CHUNK_BYTES",
    "SSD_MIN_GROW_BYTES",
    "SSD_SLAB_BYTES",
    "SSD_STRIPE_MIN_BYTES",
    "WAKE_BYTES",
]

_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30

# ---- memory layout ------------------------------------------------------------------------
# The host's memory page (bytes): the unit the host pool maps and gives back to the OS, and the
# unit of the page audits in tba.testing. The one page-size definition in tba.
PAGE_BYTES: int = mmap.PAGESIZE
# O_DIRECT alignment (bytes) of the address, file offset and length of every direct transfer
# the SSD offloader makes; a host reload buffer starts at the stored bytes' address modulo this
# (Note [Reload buffers at the source's page offset]) so whole blocks move without a copy.
# 4096 is the logical block size of NVMe drives and the page of x86 and most ARM kernels.
DIRECT_IO_ALIGNMENT: int = 4 * _KiB

# ---- the engine (tba/cache/engine) --------------------------------------------------------
# Queued store bytes (bytes) at which a save wakes the store workers (Note [Batched hand-offs]):
# a wake-up costs a thread switch and a GIL hand-off, more than copying a small tensor.
WAKE_BYTES: int = 1 * _MiB
# Largest CPU storage (bytes) moved on the training thread instead of a worker when the
# offloader can take it at once (tba/cache/engine/workers.py): below this a hand-off costs
# more than the copy (measured by benchmarks/hook_overhead.py).
INLINE_MAX_BYTES: int = 64 * _KiB
# How often (seconds) a bounded wait checks that the workers are alive and the engine open;
# `transfer_timeout_s` (configuration) bounds the wait itself.
POLL_S: float = 0.5
# Transfer events (count) the Chrome-trace recorder keeps per step (`cache.export_trace`);
# later events of the step are not recorded, so a runaway step cannot grow memory unbounded.
MAX_TRACE_EVENTS_PER_STEP: int = 1_000_000

# ---- the adaptive policy (tba/cache/steps/steps.py) --------------------------------------
# Factor (plain) by which the measured write bandwidth must move from the profiled one before
# the policy re-profiles: smaller factors re-profile on the ordinary jitter of a shared disk.
BANDWIDTH_DRIFT: float = 1.5

# ---- the closed loop (tba/cache/policy/closed_loop.py, docs/policy.md) --------------------
# Free memory a keep step needs (plain factor) over the bytes it keeps in addition: a keep step
# holds every activation, so the loop measures keep steps only with this headroom.
CLOSED_LOOP_KEEP_MARGIN: float = 1.25
# Steps (count) per run of one kind (offload or keep) in a measurement; only the last is timed,
# so a step never pays for the transfers of the other kind's step before it.
CLOSED_LOOP_RUN: int = 2
# Confidence (fraction) of each one-sided distribution-free bound on the median paired ratio.
CLOSED_LOOP_CONFIDENCE: float = 0.8
# Confidence (fraction) of the upper bound a pass also needs on the pairs of the boundary and of
# the larger ones measured, scaled to its bytes (Note [Bracket search]): a boundary just over
# the budget must not pass on noise.
CLOSED_LOOP_PASS_CONFIDENCE: float = 0.9
# Pairs (count) before a verdict: the fewest that bound the median at CLOSED_LOOP_CONFIDENCE.
CLOSED_LOOP_MIN_PAIRS: int = 3
# Pairs (count) per boundary at most; still undecided after them: the cheaper side (fewer blocks).
CLOSED_LOOP_MAX_PAIRS: int = 5
# Measured steps (count) per check at most: a check settles within them. Room for three
# boundaries measured to CLOSED_LOOP_MAX_PAIRS (Note [Bracket search]).
CLOSED_LOOP_MAX_PROBE_STEPS: int = 60
# Note [Disturbed steps]: a timed probe step this much slower than the fastest of its kind in
# the same measurement is no sample, at most CLOSED_LOOP_MAX_DISTURBED times per boundary.
CLOSED_LOOP_DISTURBED: float = 0.05
CLOSED_LOOP_MAX_DISTURBED: int = 2
# Worth it (plain factor): a boundary's offloaded fraction of the blocks' activation bytes must
# be at least this times its step-time overhead (5: each 1% of step time saves >= 5% of bytes).
CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD: float = 5.0
# Steady steps (count) between runs of keep steps that refresh the keep baseline.
CLOSED_LOOP_KEEP_EVERY: int = 20
# Timed keep steps (count) the keep baseline is taken from: the second fastest of them (other
# work only adds time, so a few disturbed keep steps leave it as it was).
CLOSED_LOOP_BASELINE_KEEPS: int = 5
# Steady steps (count) whose median is compared with the keep baseline for drift.
CLOSED_LOOP_DRIFT_WINDOW: int = 5
# Steady steps (count) between re-checks from a new profile: contention that went away is seen
# only by offloading again.
CLOSED_LOOP_RECHECK_EVERY_STEPS: int = 500

# ---- host pool (tba/offloaders/host.py) ---------------------------------------------------
# Alignment (bytes) of extents in the host pool: keeps every stored tensor aligned for vector
# copies and for any dtype, at most 511 bytes lost per tensor.
HOST_POOL_ALIGNMENT: int = 512
# Smallest slab (bytes) the host pool maps when it grows: fewer, larger mappings (pinning a
# mapping is a system call of its own) without holding much more than asked for.
HOST_POOL_MIN_SLAB_BYTES: int = 64 * _MiB

# ---- SSD offloader (tba/offloaders/ssd) ---------------------------------------------------
# Size (bytes) of a regular slab file (the SSD offloader's `slab_bytes` default): extents are
# carved from preallocated files, so no store creates or grows a file on the hot path.
SSD_SLAB_BYTES: int = 1 * _GiB
# First slab (bytes) of a directory when it grows on demand; later ones double the capacity up
# to SSD_SLAB_BYTES each, so the first step overshoots its peak by at most about 2x.
SSD_MIN_GROW_BYTES: int = 4 * _MiB
# Smallest tensor (bytes) striped over several directories (drives): below it one drive's
# latency dominates and striping only adds requests.
SSD_STRIPE_MIN_BYTES: int = 1 * _MiB
# Staging buffer size (bytes) of the posix engine, the unit of one O_DIRECT request: large
# enough for the drive's full bandwidth, small enough that a few buffers per thread stay cheap.
SSD_CHUNK_BYTES: int = 8 * _MiB
# Block (bytes) of the SSD offloader's checksums (part of the on-disk format: one 64-bit sum
# per block, so a corrupted read names the block where it differs).
CHECKSUM_BLOCK_BYTES: int = 512

# ---- malloc hook diagnosis (tba/malloc_hook) -----------------------------------------------
# Note [Registration shortfall]: with TBA_HOOK_REGISTER=all the hook should see most of what
# PyTorch reserves; less than this fraction (plain) registered counts as a shortfall ...
REGISTRATION_SHORTFALL_RATIO: float = 0.5
# ... once PyTorch reserves at least this much (bytes): its 2 MiB small-pool segments are below
# the registration threshold, so small reservations always look short.
REGISTRATION_SHORTFALL_MIN_RESERVED_BYTES: int = 256 * _MiB
