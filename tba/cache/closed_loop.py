"""`OverheadLoop`: checks the adaptive boundary against measured step time (closed loop).

Note [Closed loop]: the TBA rule decides from write bandwidth against compute time and cannot
see that transfers also take CPU time, memory bandwidth or PCIe away from compute. After the
rule has decided (boundary ``c``), the loop measures steps: steps that keep every block (the
keep probe: nothing offloaded at all) alternate with steps that offload blocks ``[0, c)``, until
each has ``num_samples`` samples. The overhead is the median, over adjacent (keep, offload)
pairs, of the offload step's time over the keep step's, minus 1: pairing cancels slow drift of
the machine (other processes, clocks), the median a single disturbed step. When the pairs
disagree by more than twice ``max_step_overhead`` (a loaded machine), pairs are added, up to
``MAX_SAMPLES``; if they still disagree, other processes' load (which only ever adds time)
dominates the pairs, and the overhead is taken from each kind's fastest step instead (the
least disturbed one; the cache's own transfers slow every offloading step, the fastest too). If the overhead is within ``max_step_overhead``, ``c``
stands. Otherwise the
overhead is taken as proportional to the bytes offloaded, the largest boundary whose bytes fit
the allowed overhead is measured next, and so on down to keeping every block. Conditions are
checked again (a new profile, the rule, then these measurements) every ``recheck_every`` steady
steps (contention that went away is seen only by offloading again) and when the median of the
last ``window`` steps drifts by more than ``drift`` from the accepted time (a slower disk shows
here too: it replaces the write-bandwidth trigger of the open rule, whose measurements move
with the boundary). The loop only reads step times: the cache's steps feed it (``observe``)
and apply the boundary it returns. Tested with an injected clock in
tests/cache/test_closed_loop.py.

A keep step holds every activation of the step in memory, which offloading was meant to avoid:
the loop measures only when the memory free at the decision covers what the rule's boundary
would have offloaded (``free_memory_bytes``, with a margin); otherwise the rule's boundary stands
and the decision says why. ``max_step_overhead=None`` turns the loop off.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence

__all__ = ["OverheadLoop", "free_memory_bytes", "KEEP_MARGIN"]

logger = logging.getLogger(__name__)

KEEP_MARGIN = 1.25  # free memory a keep step needs, over the bytes it keeps in addition
RECHECK_EVERY_STEPS = 500  # steady steps between re-checks
NUM_SAMPLES = 3  # step-time samples per boundary in a check
MAX_SAMPLES = 9  # ... when the pairs disagree
DRIFT_WINDOW = 5  # steady steps whose median is compared with the accepted time
STEP_DRIFT = 1.25  # a re-check when that median moves by this factor


def free_memory_bytes(cuda: bool) -> int:
    """Memory a keep step could still use: on CUDA what the driver has free plus what torch's
    caching allocator holds unused; on CPU the memory the OS reports available."""
    if cuda:
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    import psutil  # not at module level: ``import tba`` loads no native library

    return int(psutil.virtual_memory().available)


def _median(values: Iterable[float]) -> float:
    # Not ``statistics.median``: importing ``statistics`` loads native modules, and
    # ``import tba`` loads none.
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class OverheadLoop:
    """Chooses among boundaries ``[0, rule]`` by measured step time.

    Args:
        max_overhead: the allowed step-time overhead over keeping every block (0.05 = 5%).
    """

    def __init__(
        self,
        max_overhead: float,
        *,
        num_samples: int = NUM_SAMPLES,
        max_samples: int = MAX_SAMPLES,
        recheck_every: int | None = None,
        window: int = DRIFT_WINDOW,
        drift: float = STEP_DRIFT,
    ) -> None:
        self.max_overhead = max_overhead
        self.num_samples = num_samples
        self.max_samples = max(max_samples, num_samples)
        self.recheck_every = RECHECK_EVERY_STEPS if recheck_every is None else recheck_every
        self.drift = drift
        self.rule = 0  # the boundary the rule allows
        self.candidate = 0  # the boundary being measured (probing) or accepted (steady)
        self.probing = False
        self.keep_s: float | None = None  # medians of the last completed check
        self.offload_s: float | None = None
        self.overhead: float | None = None  # median paired overhead of the last check
        self.reason = "not started"
        self._block_bytes: tuple[int, ...] = ()
        self._keep: list[float] = []
        self._offload: list[float] = []
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._num_steady = 0


    def start(self, rule: int, block_bytes: Sequence[int]) -> int:
        """The rule allows blocks ``[0, rule)``: measure it; returns the next step's boundary."""
        self.rule = rule
        self._block_bytes = tuple(block_bytes)
        self.keep_s = self.offload_s = self.overhead = None
        return self._probe(rule, "after the profile")

    def observe(self, ran_at: int, seconds: float) -> int | None:
        """A step ran ``seconds`` with blocks ``[0, ran_at)`` offloaded (0: nothing at all);
        returns the boundary for the next step, or None when conditions must be checked
        again from a new profile (``reason`` says why)."""
        if self.probing:
            if ran_at == 0:
                self._keep.append(seconds)
            elif ran_at == self.candidate:
                self._offload.append(seconds)
            num_pairs = min(len(self._keep), len(self._offload))
            if num_pairs >= self.num_samples and (
                num_pairs >= self.max_samples or not self._noisy()
            ):
                return self._judge()
            return 0 if len(self._keep) <= len(self._offload) else self.candidate
        if ran_at != self.candidate:
            return self.candidate
        self._num_steady += 1
        self._recent.append(seconds)
        if self.rule and self._num_steady >= self.recheck_every:
            self._recheck(f"periodic re-check after {self._num_steady} steps")
            return None
        accepted = self.offload_s if self.candidate else self.keep_s
        if accepted and len(self._recent) == self._recent.maxlen:
            ratio = _median(self._recent) / accepted
            if not 1 / self.drift <= ratio <= self.drift:
                self._recheck(f"step time moved {ratio:.2f}x")
                return None
        return self.candidate

    # ------------------------------------------------------------------ internals
    def _offloaded_bytes(self, n: int) -> int:
        return sum(self._block_bytes[:n])

    def _recheck(self, why: str) -> None:
        self.probing = False
        self._num_steady = 0
        self._recent.clear()
        self.reason = f"checking again: {why}"
        logger.info("tba adaptive: %s", self.reason)

    def _probe(self, candidate: int, why: str) -> int:
        self._keep, self._offload = [], []
        self._recent.clear()
        self._num_steady = 0
        self.candidate = candidate
        if candidate == 0:
            self.probing = False
            self.reason = "the rule keeps every block: nothing to measure"
            return 0
        self.probing = True
        self.reason = (
            f"closed loop measuring blocks [0, {candidate}) against keeping every block "
            f"({why})"
        )
        logger.info("tba adaptive: %s", self.reason)
        return 0  # a keep step first

    def _ratios(self) -> list[float]:
        return [o / k - 1.0 if k > 0 else 0.0 for k, o in zip(self._keep, self._offload)]

    def _noisy(self) -> bool:
        ratios = self._ratios()
        return max(ratios) - min(ratios) > 2 * self.max_overhead

    def _judge(self) -> int:
        keep_s, offload_s = _median(self._keep), _median(self._offload)
        ratios = self._ratios()
        noisy = self._noisy()
        if noisy:
            fastest_keep = min(self._keep)
            overhead = min(self._offload) / fastest_keep - 1.0 if fastest_keep > 0 else 0.0
            how = f"fastest steps {overhead:+.1%}: the pairs disagree"
        else:
            overhead = _median(ratios)
            how = f"median of {len(ratios)} paired ratios {overhead:+.1%}"
        self.keep_s, self.offload_s, self.overhead = keep_s, offload_s, overhead
        c = self.candidate
        measured = (
            f"step {offload_s * 1e3:.1f} ms offloading blocks [0, {c}) vs {keep_s * 1e3:.1f} ms "
            f"keeping every block (medians of {len(self._offload)} and {len(self._keep)}; "
            f"{how}, pairs spread {min(ratios):+.1%} to {max(ratios):+.1%})"
        )
        if overhead <= self.max_overhead + 1e-9:  # inclusive, whatever the rounding
            return self._settle(c, f"closed loop: {measured} <= max_step_overhead "
                                   f"{self.max_overhead:.0%}")
        per_byte = overhead / max(self._offloaded_bytes(c), 1)  # fraction of keep per byte
        allowed = self.max_overhead
        n = c - 1
        while n > 0 and self._offloaded_bytes(n) * per_byte > allowed:
            n -= 1
        if n == 0:
            return self._settle(0, f"closed loop: {measured} > max_step_overhead "
                                   f"{self.max_overhead:.0%}, and even block 0 alone would "
                                   "exceed it: keep every block")
        logger.info("tba adaptive: %s > %.0f%%: measuring blocks [0, %d)", measured,
                    self.max_overhead * 100, n)
        return self._probe(n, f"{measured} > max_step_overhead {self.max_overhead:.0%}")

    def _settle(self, n: int, reason: str) -> int:
        self.probing = False
        self.candidate = n
        self.reason = reason
        self._num_steady = 0
        self._recent.clear()
        logger.info("tba adaptive: %s", reason)
        return n
