"""`ScriptedWorld`: a model in a real cache whose step times are scripted and whose best
boundary is known, for tests of the adaptive policy's decisions.

The closed loop (Note [Closed loop]) decides from measured step times. Whether it finds the
best boundary can only be judged where the best is known: a world whose compute and transfer
times are chosen. A :class:`ScriptedWorld` is that world, built from the supported seams
(:func:`drive_closed_loop`, :class:`FakeStepClock`, :class:`OffloaderWrapper`,
:class:`FakeOffloader`), in a real ``tba.TensorCache`` running real forward and backward passes
of a small MLP (tiny tensors, so a step costs milliseconds):

- each block's forward pre-hook advances the clock ``forward_s``, its backward pre-hook
  ``backward_s``, each times a factor drawn uniformly from ``[1 - noise, 1 + noise]``;
- storing a block's bytes advances it ``transfer_s`` (times such a factor), in proportion to the
  bytes stored: transfers that take time from compute. Each block's forward hook waits for the
  stores (``cache.wait_for_stores``), so every store lands in its own step;
- with probability ``outlier_rate`` a step is an outlier: it takes a further fraction of the
  keep step drawn from ``outlier_range`` (``(0.1, 0.4)``: 10-40% slower);
- ``transfer_s`` may be changed between steps (a drift in transfer cost).

A step keeping every block takes ``num_blocks * (forward_s + backward_s)``; offloading blocks
``[0, n)`` adds ``n * transfer_s``. :meth:`ScriptedWorld.best_boundary` is then the largest
``n`` the policy may choose (up to the kept tail) whose overhead ``n * transfer_s / keep`` is
within its limit: ``max_step_overhead``, or what its saving is worth
(``tba.settings.CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD``; Note [Bracket search]).

Example:
    >>> from tba.testing import ScriptedWorld, probe
    >>> with ScriptedWorld.with_budget_boundary(4, noise=0.02, seed=1) as world:
    ...     boundaries = world.run(40)
    ...     settled = world.cache.adaptive_decision.settled_at_step is not None
    >>> world.best_boundary(), settled, boundaries[-1] in (3, 4)
    (4, True, True)
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

import tba
from tba.settings import CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD
from tba.testing._fakes import FakeOffloader
from tba.testing._probe import probe
from tba.testing._step_timing import FakeStepClock, drive_closed_loop
from tba.offloaders.wrapper import OffloaderWrapper

__all__ = ["ScriptedWorld"]

_World = TypeVar("_World", bound="ScriptedWorld")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.tanh(self.up(x)))
        return out


class _Stack(nn.Module):
    """Blocks only: every saved activation belongs to a block (the loss saves nothing)."""

    def __init__(self, num_blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


class _TimedOffloader(OffloaderWrapper):
    """A :class:`FakeOffloader` whose stores advance the world's clock."""

    def __init__(self, world: ScriptedWorld) -> None:
        super().__init__(FakeOffloader(), "scripted")
        self._world = world

    def store(self, src: torch.Tensor) -> Any:
        self._world._charge_store(src.numel() * src.element_size())
        return super().store(src)

    def store_now(self, storage: torch.UntypedStorage) -> Any:
        """Small storages are stored on the training thread, at once (Note [Small transfers
        inline]): no thread hand-off per store keeps a scripted step at milliseconds."""
        return self.store(torch.empty(0, dtype=torch.uint8).set_(storage))


class ScriptedWorld:
    """A small MLP in a real cache whose steps take scripted time (module docstring).

    Args:
        transfer_s: clock seconds that storing one block's bytes costs (``n * transfer_s``
            for blocks ``[0, n)``). Settable between steps: a drift in transfer cost.
        num_blocks: blocks of the model (12).
        forward_s: clock seconds of each block's forward (1.0).
        backward_s: clock seconds of each block's backward (2.0).
        noise: largest relative deviation of each block's (and each store's) time: factors
            are drawn uniformly from ``[1 - noise, 1 + noise]`` (0: none).
        outlier_rate: probability that a step is an outlier (0: none).
        outlier_range: an outlier step takes this fraction of the keep step more, drawn
            uniformly (``(0.1, 0.4)``: 10-40%).
        seed: seeds the model, its input and every draw: a world replays exactly.
        width: the MLP's width (tiny: a step costs milliseconds).
        **options: more ``tba.configure_tensor_cache`` options (``max_step_overhead``,
            ``keep_last_modules``, ...). The world sets the offloader (a wrapped
            :class:`FakeOffloader`), ``offload_devices=("cpu",)`` and ``min_offload_bytes=0``.

    Raises:
        ValueError: an argument is out of range (every problem listed at once).
    """

    def __init__(
        self,
        transfer_s: float,
        *,
        num_blocks: int = 12,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        noise: float = 0.0,
        outlier_rate: float = 0.0,
        outlier_range: tuple[float, float] = (0.1, 0.4),
        seed: int = 0,
        width: int = 4,
        **options: Any,
    ) -> None:
        problems = _problems(transfer_s, num_blocks, forward_s, backward_s, noise, outlier_rate,
                             outlier_range, width, options)
        if problems:
            raise ValueError("tba.testing.ScriptedWorld: " + "; ".join(problems))
        self.transfer_s = float(transfer_s)
        self.num_blocks = num_blocks
        self.forward_s, self.backward_s = float(forward_s), float(backward_s)
        self.noise, self.outlier_rate = float(noise), float(outlier_rate)
        self.outlier_range = (float(outlier_range[0]), float(outlier_range[1]))
        self.clock = FakeStepClock()
        self._rng = random.Random(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = _Stack(num_blocks, width)
            self._input = torch.randn(2, width)
        self.block_bytes = _saved_bytes_per_block(self.model, self._input)
        self._seconds_per_byte_of = 1.0 / max(self.block_bytes[0], 1)
        self._store_factor = 1.0
        self._outlier_s = 0.0
        self._handles: list[Any] = []
        for i, block in enumerate(self.model.blocks):
            self._handles += [
                block.register_forward_pre_hook(lambda *_, i=i: self._forward(i)),
                block.register_forward_hook(lambda *_: self._stores_done()),
                block.register_full_backward_pre_hook(
                    lambda *_: self.clock.advance(self.backward_s * self._factor())),
            ]
        self.offloader = self._make_offloader()
        self.cache: tba.TensorCache = tba.configure_tensor_cache(
            self.model, offloader=self.offloader, offload_devices=("cpu",), min_offload_bytes=0,
            **options,
        )
        drive_closed_loop(self.cache, clock=self.clock, free_bytes=lambda: 1 << 40,
                          knee=self._knee or None)

    #: Whether the loop is told transfers overlap compute (Note [Predictions under a knee]).
    _knee = False

    def _make_offloader(self) -> OffloaderWrapper:
        """The world's offloader (:class:`GpuWorld` scripts a pool in its own)."""
        return _TimedOffloader(self)

    @classmethod
    def with_budget_boundary(cls, boundary: int, **kwargs: Any) -> ScriptedWorld:
        """A world whose largest boundary within ``max_step_overhead`` (default 0.05) is
        ``boundary``: ``transfer_s`` puts the budget halfway between ``boundary`` and
        ``boundary + 1`` blocks. :meth:`best_boundary` may be lower where the worth-it rule
        binds (by default when a block costs more than a fifth of its share of the bytes: with
        12 blocks, ``boundary`` 1 and 2 give a best of 0).

        Example:
            >>> ScriptedWorld.transfer_s_for(3)  # 5% of a 36 s keep step over 3.5 blocks
            0.5142857142857143
        """
        keys = ("num_blocks", "forward_s", "backward_s", "max_step_overhead")
        return cls(cls.transfer_s_for(boundary, **{k: kwargs[k] for k in keys if k in kwargs}),
                   **kwargs)

    @staticmethod
    def transfer_s_for(
        boundary: int, *, num_blocks: int = 12, forward_s: float = 1.0, backward_s: float = 2.0,
        max_step_overhead: float = 0.05,
    ) -> float:
        """The ``transfer_s`` that puts ``max_step_overhead`` halfway between ``boundary`` and
        ``boundary + 1`` offloaded blocks."""
        if type(boundary) is not int or boundary < 0:
            raise ValueError(f"tba.testing.ScriptedWorld: boundary={boundary!r}: pass an int >= 0")
        keep_s = num_blocks * (forward_s + backward_s)
        return max_step_overhead * keep_s / (boundary + 0.5)

    # ------------------------------------------------------------------ the answer
    @property
    def keep_step_s(self) -> float:
        """Clock seconds of a step that keeps every block (without noise)."""
        return self.num_blocks * (self.forward_s + self.backward_s)

    def best_boundary(self, transfer_s: float | None = None) -> int:
        """The largest boundary the policy may choose (up to the kept tail) whose overhead is
        within its limit at ``transfer_s`` (default: the current one); 0 when none is."""
        per_block = (self.transfer_s if transfer_s is None else transfer_s) / self.keep_step_s
        config = self.cache.config
        budget = config.max_step_overhead
        top = max(0, self.num_blocks - config.keep_last_modules)
        total = sum(self.block_bytes)
        best = 0
        for n in range(1, top + 1):
            overhead = per_block * sum(self.block_bytes[:n]) / self.block_bytes[0]
            worth = sum(self.block_bytes[:n]) / total / CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD
            if budget is not None and overhead <= min(budget, worth) + 1e-12:
                best = n
        return best

    # ------------------------------------------------------------------ running
    def step(self) -> int:
        """One training step (forward and backward); returns the boundary it ran at (0: no
        block offloaded, as in the loop's keep steps)."""
        low, high = self.outlier_range
        if self.outlier_rate and self._rng.random() < self.outlier_rate:
            self._outlier_s = self.keep_step_s * self._rng.uniform(low, high)
        with warnings.catch_warnings():
            # The first block's input needs no gradient: its backward pre-hook fires on the
            # gradient of its output, which is the time it stands for.
            warnings.filterwarnings("ignore", message="Full backward hook is firing when")
            self.model(self._input).backward()
        return probe(self.cache).history[-1][2]

    def run(self, num_steps: int) -> list[int]:
        """``num_steps`` steps; the boundary each ran at."""
        return [self.step() for _ in range(num_steps)]

    def close(self) -> None:
        """Close the cache and remove the world's hooks: the model is left as it was built."""
        self.cache.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self: _World) -> _World:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ the script
    def _stores_done(self) -> None:
        """A block's forward ends: its stores (and the time they cost) land in this step."""
        self.cache.wait_for_stores(60)

    def _factor(self) -> float:
        return 1.0 + self._rng.uniform(-self.noise, self.noise) if self.noise else 1.0

    def _forward(self, block: int) -> None:
        """A block's forward begins: its compute time (and the outlier's, in the first)."""
        extra, self._outlier_s = (self._outlier_s, 0.0) if block == 0 else (0.0, self._outlier_s)
        self.clock.advance(self.forward_s * self._factor() + extra)
        self._store_factor = self._factor()  # the stores of this block, on a worker thread

    def _charge_store(self, num_bytes: int) -> None:
        self.clock.advance(self.transfer_s * self._store_factor * num_bytes
                           * self._seconds_per_byte_of)


def _saved_bytes_per_block(model: _Stack, x: torch.Tensor) -> list[int]:
    """Bytes of the distinct storages each block saves for backward (as the cache counts
    them: parameters and their views excluded)."""
    current = [0]
    seen: dict[int, int] = {}  # storage pointer -> the block that saved it first
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            seen.setdefault(pointer, current[0])
            sizes[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    sizes: dict[int, int] = {}
    handles = [block.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
               for i, block in enumerate(model.blocks)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x)
        del loss
    finally:
        for handle in handles:
            handle.remove()
    per_block = [0] * len(model.blocks)
    for pointer, block in seen.items():
        per_block[block] += sizes[pointer]
    return per_block


def _problems(transfer_s: float, num_blocks: int, forward_s: float, backward_s: float,
              noise: float, outlier_rate: float, outlier_range: Sequence[float], width: int,
              options: dict[str, Any]) -> list[str]:
    problems = []
    for name, value in (("transfer_s", transfer_s), ("forward_s", forward_s),
                        ("backward_s", backward_s)):
        if not (isinstance(value, (int, float)) and value >= 0):
            problems.append(f"{name}={value!r}: pass seconds >= 0")
    for name, count in (("num_blocks", num_blocks), ("width", width)):
        if type(count) is not int or count < 1:
            problems.append(f"{name}={count!r}: pass an int >= 1")
    if not (isinstance(noise, (int, float)) and 0 <= noise < 1):
        problems.append(f"noise={noise!r}: pass a fraction in [0, 1) (0.02: +-2%)")
    if not (isinstance(outlier_rate, (int, float)) and 0 <= outlier_rate <= 1):
        problems.append(f"outlier_rate={outlier_rate!r}: pass a probability in [0, 1]")
    if not (len(outlier_range) == 2 and 0 <= outlier_range[0] <= outlier_range[1]):
        problems.append(f"outlier_range={outlier_range!r}: pass (low, high) with 0 <= low <= high")
    taken = sorted({"offloader", "offload_devices", "min_offload_bytes"} & set(options))
    if taken:
        problems.append(f"{', '.join(taken)} given: the world sets them (a scripted FakeOffloader "
                        "on the CPU, every storage managed); leave them out")
    return problems
