"""`GpuWorld`: a :class:`ScriptedWorld` whose step times follow a GPU's: transfers that hide
under compute up to a knee, and a pinned pool that costs time when it grows.

Note [A GPU world on scripted time]: on a GPU a transfer runs on its own copy engine, beside
the compute: it costs the step nothing until the link is saturated, then almost all of what
it does not hide (a knee, not the line of :class:`ScriptedWorld`). And the host pool costs
time when it grows: allocating and pinning new host memory took 0.5-0.8 s per GB on the H100
host (the first offloading step after keep steps spent 2.0-2.3 s). A :class:`GpuWorld` scripts
both on the world's clock, in the same real cache, real policy (rule and closed loop) and
small MLP as :class:`ScriptedWorld`:

- each block computes ``forward_s`` forward and ``backward_s`` backward (times a factor drawn
  from ``[1 - noise, 1 + noise]`` per block), and each block's activations count as
  ``block_bytes`` bytes (the model's tiny tensors scaled);
- offloading blocks ``[0, n)`` moves ``n * block_bytes`` each way. Stores hide under the whole
  forward and the backward of the kept blocks ``[n, N)`` (a block's store must land before
  its own backward); loads hide under the whole backward. What a direction's link time
  (``n * block_bytes / bytes_per_s``, each block's share times its own noise factor) exceeds
  its window is added to the step (at the first block's backward, the step's last);
- the pool (``pool_bytes``) grows when a step's stores hold more than it has: each new byte
  costs ``pool_growth_s_per_byte`` on the clock, and the store reports those seconds as pool
  growth (``tba.offloaders.cpu_time.charge_pool_growth``; Note [Pool growth is not transfer
  time]). ``reserve(0)`` (the cache giving the pool back) empties it: the world counts it in
  ``num_pool_given_back`` and the next offloading step pays the growth again;
- outlier steps as :class:`ScriptedWorld`'s.

:meth:`GpuWorld.physical_bound` is the most blocks (up to the kept tail) whose transfers hide:
exposed time 0 without noise. :meth:`GpuWorld.h100` is the H100 preset: GPT-2 12 x 2048, seq
1024, batch 8, bf16, ~0.6 GB saved per block, 77 ms keep step, 47 GB/s each way, 0.65 s per GB
of new pinned pool; :meth:`GpuWorld.with_bound` puts the knee halfway between ``bound`` and
``bound + 1`` blocks (the sweep's worlds).

Example:
    >>> from tba.testing import GpuWorld
    >>> with GpuWorld.h100(noise=0.02, seed=1, max_step_overhead=0.02) as world:
    ...     boundaries = world.run(70)
    >>> world.physical_bound(), boundaries[-1] in (3, 4), world.pool_growth_s > 0
    (4, True, True)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tba.offloaders.cpu_time import charge_pool_growth
from tba.offloaders.wrapper import OffloaderWrapper
from tba.testing._fakes import FakeOffloader
from tba.testing._scripted_world import ScriptedWorld

__all__ = ["GpuWorld"]

GB = 1e9
# The H100 figures (Note [A GPU world on scripted time]).
H100_KEEP_STEP_S = 0.077
H100_BLOCK_BYTES = 0.6 * GB
H100_BYTES_PER_S = 47e9
H100_POOL_GROWTH_S_PER_GB = 0.65


class _PoolOffloader(OffloaderWrapper):
    """A :class:`FakeOffloader` with a scripted pool: stores go to the cache's workers (no
    inline ``store_now``), so the growth they report lands in the step's counters."""

    passes_store_now = False

    def __init__(self, world: GpuWorld) -> None:
        super().__init__(FakeOffloader(), "gpu-world")
        self._world = world
        self._sizes: dict[Any, int] = {}
        self._lock = threading.Lock()

    def store(self, src: torch.Tensor) -> Any:
        num_bytes = src.numel() * src.element_size()
        token = super().store(src)
        with self._lock:
            self._sizes[token] = num_bytes
        self._world._stored(num_bytes)
        return token

    def release(self, token: Any) -> None:
        with self._lock:
            num_bytes = self._sizes.pop(token, 0)
        self._world._released(num_bytes)
        super().release(token)

    def reserve(self, num_bytes: int) -> None:
        if num_bytes <= 0:
            self._world._give_back()
        super().reserve(num_bytes)


class GpuWorld(ScriptedWorld):
    """A GPU's step times on scripted time (module docstring).

    Args:
        bytes_per_s: link bandwidth each way (store and load), in the world's bytes.
        block_bytes: the bytes each block offloads, in the world's bytes (the model's tiny
            tensors count as this much).
        pool_growth_s_per_byte: clock seconds each new byte of pool costs on first use (0:
            free).
        read_bytes_per_s: the load direction's bandwidth (default ``bytes_per_s``).
        **kwargs: :class:`ScriptedWorld`'s (``num_blocks``, ``forward_s``, ``backward_s``,
            ``noise``, ``outlier_rate``, ``seed``, cache options); ``transfer_s`` is 0 (the
            knee replaces it).

    Raises:
        ValueError: an argument is out of range (every problem listed at once).
    """

    def __init__(self, bytes_per_s: float, *, block_bytes: float = H100_BLOCK_BYTES,
                 pool_growth_s_per_byte: float = 0.0, read_bytes_per_s: float | None = None,
                 **kwargs: Any) -> None:
        problems = [f"{name}={value!r}: pass a number > 0" for name, value in (
            ("bytes_per_s", bytes_per_s), ("block_bytes", block_bytes),
            ("read_bytes_per_s", bytes_per_s if read_bytes_per_s is None else read_bytes_per_s))
            if not (isinstance(value, (int, float)) and value > 0)]
        if not (isinstance(pool_growth_s_per_byte, (int, float)) and pool_growth_s_per_byte >= 0):
            problems.append(f"pool_growth_s_per_byte={pool_growth_s_per_byte!r}: pass seconds >= 0")
        if "transfer_s" in kwargs:
            problems.append("transfer_s given: a GpuWorld's transfers cost by the knee; leave it out")
        if problems:
            raise ValueError("tba.testing.GpuWorld: " + "; ".join(problems))
        self.bytes_per_s = float(bytes_per_s)
        self.read_bytes_per_s = float(read_bytes_per_s or bytes_per_s)
        self.world_block_bytes = float(block_bytes)
        self.pool_growth_s_per_byte = float(pool_growth_s_per_byte)
        self.pool_bytes = 0.0  # the pool's size now (world bytes)
        self.pool_growth_s = 0.0  # clock seconds the pool's growth cost so far
        self.num_pool_given_back = 0
        self._held = 0.0
        self._step_bytes = 0.0
        self._lock = threading.Lock()
        super().__init__(0.0, **kwargs)
        self._scale = self.world_block_bytes / max(self.block_bytes[0], 1)
        self._handles.append(self.model.blocks[0].register_full_backward_pre_hook(
            lambda *_: self._expose()))

    _knee = True  # transfers overlap compute, as on CUDA

    def _make_offloader(self) -> OffloaderWrapper:
        return _PoolOffloader(self)

    # ------------------------------------------------------------------ presets
    @classmethod
    def h100(cls, **kwargs: Any) -> GpuWorld:
        """GPT-2 12 x 2048, seq 1024, batch 8, bf16 on an H100: 77 ms keep step (a third
        forward), 0.6 GB per block, 47 GB/s each way, new pinned pool 0.65 s per GB."""
        per_block = H100_KEEP_STEP_S / 12
        defaults: dict[str, Any] = dict(
            forward_s=per_block / 3, backward_s=2 * per_block / 3, block_bytes=H100_BLOCK_BYTES,
            pool_growth_s_per_byte=H100_POOL_GROWTH_S_PER_GB / GB)
        return cls(kwargs.pop("bytes_per_s", H100_BYTES_PER_S), **{**defaults, **kwargs})

    @classmethod
    def with_bound(cls, bound: int, **kwargs: Any) -> GpuWorld:
        """An H100-like world (:meth:`h100`'s compute and bytes) whose link puts the knee
        halfway between ``bound`` and ``bound + 1`` blocks: ``bound`` blocks hide, one more
        exposes half a block's transfer."""
        probe = cls.h100(**kwargs)
        try:
            probe.bytes_per_s = probe.read_bytes_per_s = probe.bandwidth_for(bound)
            return cls.h100(**{**kwargs, "bytes_per_s": probe.bytes_per_s})
        finally:
            probe.close()

    def bandwidth_for(self, bound: int) -> float:
        """The link bandwidth (each way) whose exposed time at ``bound + 1`` blocks is half a
        block's transfer (bisection: that fraction falls as the bandwidth grows). Set
        ``bytes_per_s`` and ``read_bytes_per_s`` to it between steps for a drift."""
        if type(bound) is not int or not 1 <= bound < self.num_blocks:
            raise ValueError(f"tba.testing.GpuWorld: bound={bound!r}: pass an int in "
                             f"[1, {self.num_blocks - 1}]")
        low, high = 1e3, 1e15
        for _ in range(200):
            mid = (low * high) ** 0.5
            exposed = self.exposed_s(bound + 1, mid, mid)
            if exposed / (self.world_block_bytes / mid) > 0.5:
                low = mid
            else:
                high = mid
        return high

    # ------------------------------------------------------------------ the answer
    def exposed_s(self, n: int, bytes_per_s: float | None = None,
                  read_bytes_per_s: float | None = None) -> float:
        """Step time the transfers of blocks ``[0, n)`` do not hide (without noise)."""
        write = bytes_per_s or self.bytes_per_s
        read = read_bytes_per_s or (self.read_bytes_per_s if bytes_per_s is None else write)
        moved = n * self.world_block_bytes
        nb = self.num_blocks
        store_window = nb * self.forward_s + (nb - n) * self.backward_s
        load_window = nb * self.backward_s
        return max(0.0, moved / write - store_window) + max(0.0, moved / read - load_window)

    def physical_bound(self) -> int:
        """The most blocks (up to the kept tail) whose transfers hide: no exposed time."""
        top = max(0, self.num_blocks - self.cache.config.keep_last_modules)
        return max([n for n in range(top + 1) if self.exposed_s(n) <= 1e-12])

    def best_boundary(self, transfer_s: float | None = None) -> int:
        """:meth:`physical_bound` (``transfer_s`` has no meaning here)."""
        return self.physical_bound()

    # ------------------------------------------------------------------ the script
    def _stored(self, num_bytes: int) -> None:
        """A store (on a worker): count its bytes, grow the pool if they do not fit."""
        world_bytes = num_bytes * self._scale
        with self._lock:
            self._step_bytes += world_bytes
            self._held += world_bytes
            grown = max(0.0, self._held - self.pool_bytes)
            self.pool_bytes += grown
            seconds = grown * self.pool_growth_s_per_byte
            self.pool_growth_s += seconds
        if seconds > 0:
            self.clock.advance(seconds)
            charge_pool_growth(seconds)

    def _released(self, num_bytes: int) -> None:
        with self._lock:
            self._held = max(0.0, self._held - num_bytes * self._scale)

    def _give_back(self) -> None:
        with self._lock:
            if self.pool_bytes > self._held:
                self.pool_bytes = self._held
                self.num_pool_given_back += 1

    def _expose(self) -> None:
        """The first block's backward begins (the step's last compute): what the link did not
        hide this step is waited for here."""
        with self._lock:
            moved, self._step_bytes = self._step_bytes, 0.0
        if moved <= 0:
            return
        n = moved / self.world_block_bytes
        nb = self.num_blocks
        store_window = nb * self.forward_s + (nb - n) * self.backward_s
        load_window = nb * self.backward_s
        blocks = max(1, round(n))  # each block's transfer its own noise factor
        write = sum(self._factor() for _ in range(blocks)) / blocks
        read = sum(self._factor() for _ in range(blocks)) / blocks
        exposed = (max(0.0, moved / self.bytes_per_s * write - store_window)
                   + max(0.0, moved / self.read_bytes_per_s * read - load_window))
        self.clock.advance(exposed)

    def _charge_store(self, num_bytes: int) -> None:
        """No clock time per store: the copy engine runs beside compute (:meth:`_expose`)."""
