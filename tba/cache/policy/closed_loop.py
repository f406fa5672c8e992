"""`OverheadLoop`: checks the adaptive boundary against measured step time (closed loop).

Note [Closed loop]: the TBA rule decides from write bandwidth against compute time and cannot
see that transfers also take CPU time, memory bandwidth or PCIe away from compute. After the
rule has decided (boundary ``c``: blocks ``[0, c)`` may go), the loop measures steps and keeps
only a boundary that (a) costs at most ``max_overhead`` over steps that keep every block, and
(b) is worth its cost.

*Measuring a boundary* ``n``: runs of two steps keeping every block (keep steps: nothing
offloaded at all) alternate with runs of two steps offloading ``[0, n)``, and only the second
step of each run is timed. Offloading leaves work behind for the steps after it (memory to
fault in again, I/O still draining): measured on the 2-core CPU machine, a keep step right
after an offload step ran 12% slower than one after a keep step, and an offload step after an
offload step 17-36% slower than one after a keep step, so strictly alternating steps hid
most of the cost. The second step of a run sees what a steady run sees. Each (keep, offload)
pair of second steps gives a ratio, and the verdict comes from their median and
distribution-free bounds on it (Note [Bounds on the median ratio]), and from the pairs of the
other boundaries measured in the same check (Note [Bracket search]): passed, over, or, while
neither, more pairs (from ``min_pairs`` to ``max_pairs``); still undecided, the cheaper side:
counted over. Pairing cancels a machine that speeds up or slows down during the measurement,
the median and its bounds a disturbed step; no decision rests on the fastest sample.

*Worth it*: offloading ``[0, n)`` saves ``s`` = its bytes over all the blocks' offloadable
bytes. It is worth a step-time overhead of at most ``s / min_saving_per_overhead`` (by default
5: each 1% of step time must take at least 5% of the blocks' activation bytes out of memory;
at the 5% budget a boundary must save 25%, one block of twelve, 8.3%, may cost 1.7%): a
boundary's *limit* is the smaller of that and ``max_overhead``: a boundary passes when its median
and an upper bound on it are within its limit (Note [Bracket search]).
When nothing qualifies every block is kept (the keep steps have shown there is memory for it).

*A check* searches ``[0, c]``, ``c`` first (where transfers hide, the rule is right), by a
bracket: the largest boundary known within and the smallest known over, measured or predicted
from what was measured, each verdict using every pair measured so far (Note [Bracket search]).
It settles at the bracket's lower end when the bracket is one block wide, and never measures
more than ``max_probe_steps`` steps (keep and offload steps alike): whatever the noise, it
settles within that many steps after it starts (at the lower end when the budget runs out).
``probe_steps`` and ``settled_at_step`` report it, and the settle event and ``reason`` say
what each end of the bracket rests on.

*Steady*: the settled boundary is watched and checked again when it drifts (Note [Steady
window], steady_window.py). The loop only reads step times: the cache's steps feed them
(``observe``) and apply the boundary it returns. Tested with scripted step times in
tests/cache/test_overhead_loop.py and, in the cache with a fake clock installed by
``tba.testing.drive_closed_loop``, tests/cache/test_closed_loop.py and (whole scripted
worlds, ``tba.testing.ScriptedWorld``) tests/cache/test_scripted_worlds.py.

Under a knee (``knee``: on CUDA, or ``tba.testing.GpuWorld``) the loop also looks up from a
settled boundary and takes steady steps far over for a known-over boundary (look_up.py), and
drops disturbed steps (disturbed.py). Keep steps need memory (keep_memory.py); events are
``LoopEvent``s. ``max_step_overhead=None`` turns the loop off.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tba.cache.policy.bracket_search import BracketSearch, Verdict
from tba.cache.policy.disturbed import drop_disturbed
from tba.cache.policy.look_up import LookUp
from tba.cache.policy.loop_event import LoopEvent
from tba.cache.policy.paired_ratios import PairedOverhead
from tba.cache.policy.steady_window import SteadyWindow
from tba.settings import CLOSED_LOOP_BASELINE_KEEPS as BASELINE_KEEPS
from tba.settings import CLOSED_LOOP_CONFIDENCE as CONFIDENCE
from tba.settings import CLOSED_LOOP_DRIFT_WINDOW as DRIFT_WINDOW
from tba.settings import CLOSED_LOOP_MAX_DISTURBED as MAX_DISTURBED
from tba.settings import CLOSED_LOOP_KEEP_EVERY as KEEP_EVERY
from tba.settings import CLOSED_LOOP_MAX_PAIRS as MAX_PAIRS
from tba.settings import CLOSED_LOOP_MAX_PROBE_STEPS as MAX_PROBE_STEPS
from tba.settings import CLOSED_LOOP_MIN_PAIRS as MIN_PAIRS
from tba.settings import CLOSED_LOOP_MIN_SAVING_PER_OVERHEAD as MIN_SAVING_PER_OVERHEAD
from tba.settings import CLOSED_LOOP_PASS_CONFIDENCE as PASS_CONFIDENCE
from tba.settings import CLOSED_LOOP_RECHECK_EVERY_STEPS as RECHECK_EVERY_STEPS
from tba.settings import CLOSED_LOOP_RUN as RUN

__all__ = ["OverheadLoop", "MAX_PROBE_STEPS"]

logger = logging.getLogger(__name__)


class OverheadLoop:
    """Chooses among boundaries ``[0, rule]`` by measured step time (Note [Closed loop]).

    Args:
        max_overhead: the allowed step-time overhead over keeping every block (0.05 = 5%).
        can_keep: whether a keep step fits in memory, given the bytes it holds beyond a step
            at the running boundary (steady keep steps and re-checks ask; None: always).

    Example:
        >>> loop = OverheadLoop(0.05)
        >>> at = loop.start(2, [10, 10, 10])  # the rule allows blocks [0, 2): keep steps first
        >>> for _ in range(16):  # keep, keep, offload, offload, ...: four timed pairs
        ...     at = loop.observe(at, 1.0 if at == 0 else 1.01)
        >>> at, loop.probing, loop.probe_steps
        (2, False, 16)
    """

    def __init__(
        self,
        max_overhead: float,
        *,
        can_keep: Callable[[int], bool] | None = None,
        min_pairs: int = MIN_PAIRS,
        max_pairs: int = MAX_PAIRS,
        max_probe_steps: int = MAX_PROBE_STEPS,
        confidence: float = CONFIDENCE,
        pass_confidence: float = PASS_CONFIDENCE,
        min_saving_per_overhead: float = MIN_SAVING_PER_OVERHEAD,
        keep_every: int = KEEP_EVERY,
        window: int = DRIFT_WINDOW,
        recheck_every: int = RECHECK_EVERY_STEPS,
    ) -> None:
        self.max_overhead = max_overhead
        self.can_keep = can_keep or (lambda num_bytes: True)
        self.min_pairs = min_pairs
        self.max_pairs = max(max_pairs, min_pairs)
        self.max_probe_steps = max(max_probe_steps, 2 * RUN * min_pairs)
        self.confidence = confidence
        self.pass_confidence = pass_confidence
        self.min_saving_per_overhead = min_saving_per_overhead
        self.keep_every = keep_every
        self.window = window
        self.recheck_every = recheck_every
        self.rule = 0  # the boundary the rule allows
        self.candidate = 0  # the boundary being measured (probing) or settled (steady)
        self.probing = False
        self.last: PairedOverhead | None = None  # the last verdict, and its boundary
        self.last_tail_start: int | None = None
        self.probe_steps = 0  # measured steps of the running or last check
        self.settled_at_step: int | None = None
        self.reason = "not started"
        self.events: collections.deque[LoopEvent] = collections.deque(maxlen=256)
        self._block_bytes: tuple[int, ...] = ()
        self._search = BracketSearch(
            (), 0, max_overhead=max_overhead, min_saving_per_overhead=min_saving_per_overhead,
            confidence=confidence, pass_confidence=pass_confidence,
        )
        self.knee = False  # transfers overlap compute (CUDA): set by the cache (module docstring)
        self._limit = max_overhead  # the overhead the settled boundary may cost
        self._passed: dict[int, PairedOverhead] = {}
        self._keep: list[float] = []
        self._offload: list[float] = []
        self._num_judged = 0
        self._num_disturbed = 0
        self._steady = SteadyWindow(window=window, num_keeps=BASELINE_KEEPS)
        self._num_steady = 0
        self._num_observed = 0
        self._run_at: int | None = None  # the boundary of the running run of steps ...
        self._run_length = 0  # ... and how many steps it has
        self._up = LookUp()  # Note [Looking up]
        self._num_waited = 0  # steady steps waited for a full window far over

    # ------------------------------------------------------------------ feeding
    def start(self, rule: int, block_bytes: Sequence[int], *, step: int | None = None) -> int:
        """The rule allows blocks ``[0, rule)``: check it; returns the next step's boundary."""
        self.rule = rule
        self._block_bytes = tuple(block_bytes)
        self._steady.keeps.clear()
        self._run_at = None  # the profiled step before this was not observed
        self.last = self.last_tail_start = None
        if rule == 0:
            self.probe_steps = 0
            return self._settle(0, step, "the rule allows no block, nothing to measure")
        return self._check(rule, step, "after the profile")

    def observe(
        self, ran_at: int, seconds: float, *, step: int | None = None, grew_pool: bool = False
    ) -> int | None:
        """A step ran ``seconds`` with blocks ``[0, ran_at)`` offloaded (0: nothing at all);
        returns the boundary for the next step, or None when conditions must be checked
        again from a new profile (``reason`` says why). ``step`` numbers the step for
        ``settled_at_step`` and ``events`` (default: the loop counts the steps it saw).
        ``grew_pool``: the step's stores grew the offloader's pool: it counts in its run but
        its time is no sample (Note [Pool growth is not transfer time])."""
        self._num_observed += 1
        step = self._num_observed if step is None else step
        if ran_at == self._run_at:
            self._run_length += 1
        else:
            self._run_at, self._run_length = ran_at, 1
        # The step before it ran the same boundary, and no pool growth is in its time.
        timed = self._run_length >= RUN and not grew_pool
        if self.probing:
            return self._observe_probe(ran_at, seconds, timed, step)
        return self._observe_steady(ran_at, seconds, timed, step)

    @property
    def holds_pool(self) -> bool:
        """Whether offloading comes back soon (Note [The pool stays while the loop measures]):
        measuring, settled at a boundary that offloads (its keep runs come back to it), or
        looking up from keep (Note [Looking up])."""
        return self.probing or self.candidate != 0 or (self.knee and self.rule > 0)

    @property
    def keep_baseline_s(self) -> tuple[float, ...]:
        """The timed keep steps the keep baseline is taken from (the second fastest), oldest
        first."""
        return tuple(self._steady.keeps)

    def decision_fields(self) -> dict[str, Any]:
        """What the cache's ``BoundaryDecision`` shows of the loop."""
        last = self.last
        return dict(
            tail_start=self.candidate, keep_step_s=last.keep_s if last else None,
            offload_step_s=last.offload_s if last else None,
            step_overhead=last.overhead if last else None,
            step_overhead_bounds=(last.low, last.high) if last else None,
            measured_tail_start=self.last_tail_start, probe_steps=self.probe_steps,
            max_probe_steps=self.max_probe_steps, settled_at_step=self.settled_at_step,
        )

    # ------------------------------------------------------------------ a check
    def _check(self, top: int, step: int | None, why: str, known_within: int = 0, *,
               bisect: bool = False, known_over: dict[int, float] | None = None) -> int:
        """Search ``[known_within, top]``, ``top`` first, or with ``bisect`` the boundary the
        search picks from nothing measured (under a knee: the middle; Note [Looking up])."""
        self._search = BracketSearch(
            self._block_bytes, top, max_overhead=self.max_overhead,
            min_saving_per_overhead=self.min_saving_per_overhead, confidence=self.confidence,
            pass_confidence=self.pass_confidence, knee=self.knee, known_within=known_within,
            known_over=known_over,
        )
        self._passed = {}
        self.probe_steps = 0
        self.settled_at_step = None
        first = self._search.next_candidate() if bisect and not self._search.done else top
        return self._probe(first, step, why)

    def _probe(self, candidate: int, step: int | None, why: str) -> int:
        self._keep, self._offload, self._num_judged = [], [], 0
        self._num_disturbed = 0
        self.candidate = candidate
        self.probing = True
        self.reason = (
            f"closed loop measuring blocks [0, {candidate}) against keeping every block "
            f"({why}; {self.probe_steps} of at most {self.max_probe_steps} measured steps so far)"
        )
        self._event(step, "measure", candidate, why)
        return 0  # keep steps first

    def _next_in_probe(self, ran_at: int) -> int:
        """Runs of ``RUN`` keep steps and ``RUN`` steps at the candidate, in turn."""
        if ran_at == self._run_at and self._run_length < RUN:
            return ran_at
        return self.candidate if ran_at == 0 else 0

    def _observe_probe(self, ran_at: int, seconds: float, timed: bool, step: int) -> int:
        c = self.candidate
        if ran_at not in (0, c):  # a step started before the boundary changed (CUDA times)
            return 0
        self.probe_steps += 1
        if timed and ran_at == 0:
            self._keep.append(seconds)
            self._steady.keep(seconds)
        elif timed:
            self._offload.append(seconds)
        if timed and self.knee:  # Note [Disturbed steps]: measure another pair instead
            self._num_disturbed += drop_disturbed(self._keep if ran_at == 0 else self._offload,
                                                  MAX_DISTURBED - self._num_disturbed)
        num_pairs = min(len(self._keep), len(self._offload))
        self._num_judged = min(self._num_judged, num_pairs)
        if num_pairs > self._num_judged and num_pairs >= self.min_pairs:
            self._num_judged = num_pairs
            budget_left = self.max_probe_steps - self.probe_steps
            pairs_left = min(self.max_pairs - num_pairs, budget_left // (2 * RUN))
            verdict = self._search.judge(c, self._keep[:num_pairs], self._offload[:num_pairs],
                                         pairs_left=pairs_left)
            if verdict is not None:
                return self._conclude(verdict, step)
        return self._next_in_probe(ran_at)

    def _conclude(self, verdict: Verdict, step: int) -> int:
        c, search = self.candidate, self._search
        result = verdict.measured
        self.last, self.last_tail_start = result, c
        measured = verdict.describe(self.max_overhead, self.pass_confidence)
        passed = verdict.outcome == "pass"
        self._event(step, "pass" if passed else "fail", c, measured)
        logger.info("tba adaptive: %s", measured)
        if passed:
            self._passed[c] = result
        self._up.record(c, None if passed else result.low)
        search.conclude(verdict)
        bracket = search.describe()
        if search.done:
            low = search.predicted_low(search.hi) if search.hi not in search.verdicts else None
            if low is not None and search.hi <= search.top:
                self._up.record(search.hi, low)  # Note [Looking up]: predicted over
            return self._settle(search.lo, step, f"{measured}; {bracket}")
        if self.max_probe_steps - self.probe_steps < 2 * RUN * self.min_pairs:
            return self._settle(search.lo, step, f"{measured}; {bracket}; measuring budget spent")
        return self._probe(search.next_candidate(), step, f"{measured}; {bracket}")

    def _settle(self, n: int, step: int | None, why: str) -> int:
        self.probing = False
        self.candidate = n
        self._limit = self._search.limit(n)  # what the steady steps are held to
        self.settled_at_step = step
        self._num_steady = 0
        self._steady.recent.clear()
        self._num_waited = 0
        accepted = self._passed.get(n)
        if n == 0:
            outcome = "keep every block"
        else:
            outcome = f"offload blocks [0, {n})"
            if accepted is not None and self.last_tail_start != n:
                outcome += f" (measured {accepted.describe()})"
        self.reason = f"closed loop: {outcome}: {why}"
        settled = (f"{self.reason}; settled after {self.probe_steps} of at most "
                   f"{self.max_probe_steps} measured steps")
        self._event(step, "settle", n, settled)
        logger.info("tba adaptive: %s", settled)
        return n

    # ------------------------------------------------------------------ steady
    def _observe_steady(self, ran_at: int, seconds: float, timed: bool, step: int) -> int | None:
        c = self.candidate
        if ran_at == 0 and c > 0:  # a run of keep steps: the baseline
            if timed:
                self._steady.keep(seconds)
            return 0 if self._run_length < RUN else c
        if ran_at == self._up.at and self.knee:  # Note [Looking up]
            return self._observe_up(ran_at, seconds, timed, step)
        if ran_at != c:
            return c
        self._num_steady += 1
        if (self.knee and c < self.rule and self._steady.keeps
                and self._num_steady % self.keep_every == self.keep_every // 2):
            self._up.at = self._up.target(c, self.rule, self._search.limit)
            return self._up.at
        if self.rule and self._num_steady >= self.recheck_every:
            self._recheck(step, f"periodic re-check after {self._num_steady} steps")
            return None
        if c == 0 or not self._steady.keeps or not timed:
            return c
        drift, recent = self._steady.add(seconds), self._steady.recent
        baseline = self._steady.baseline_s()
        far = self.knee and LookUp.far_over(recent, self.window, self._limit)
        if len(recent) >= self.min_pairs and drift > self._limit + 1e-9:
            if (self.knee and drift > 2 * self._limit and not far
                    and self._num_waited < self.window):
                self._num_waited += 1  # Note [Steady steps far over]: wait for a full window
                return c
            why = (f"steady steps: median {drift:+.1%} over the keep baseline "
                   f"{baseline * 1e3:.1f} ms, more than the {self._limit:.1%} blocks [0, {c}) "
                   "may cost")
            if not self.can_keep(self._offloaded_bytes(c)):
                self._recheck(step, f"{why}, and no memory is free for keep steps")
                return None
            self._event(step, "suspect", c, why)
            if far:  # Note [Steady steps far over]: ``c`` is known over
                self._up.record(c, min(recent))
                why += f", every one of the last {self.window} at least twice that: searching below"
                if c == 1:
                    return self._settle(0, step, why)
                return self._check(c - 1, step, why, bisect=True,
                                   known_over={c: min(recent)})
            return self._check(c, step, why)
        self._num_waited = 0
        if self._num_steady % self.keep_every == 0 and self.can_keep(self._offloaded_bytes(c)):
            return 0
        return c

    def _observe_up(self, up: int, seconds: float, timed: bool, step: int) -> int:
        """Note [Looking up]: a run of steps above the settled boundary; when it shows that
        more may hide now, a check of ``[c, rule]`` from the middle."""
        if self._run_length < RUN:
            return up
        self._up.at = None
        if timed and self._steady.keeps:
            baseline, overhead = self._steady.baseline_s(), self._steady.overhead(seconds)
            last = self._up.moves_up(up, overhead, self._search.limit(up))
            if last is not None:
                why = (f"blocks [0, {up}) ran {overhead:+.1%} over the keep baseline "
                       f"{baseline * 1e3:.1f} ms{last}, within what they may cost: more may "
                       "hide now")
                self._event(step, "suspect", up, why)
                return self._check(self.rule, step, why, known_within=self.candidate,
                                   bisect=True)
        return self.candidate

    def _recheck(self, step: int, why: str) -> None:
        self.probing = False
        self._num_steady = 0
        self._steady.recent.clear()
        self.reason = f"checking again: {why}"
        self._event(step, "recheck", self.candidate, why)
        logger.info("tba adaptive: %s", self.reason)

    # ------------------------------------------------------------------ helpers
    def _offloaded_bytes(self, n: int) -> int:
        return sum(self._block_bytes[:n])

    def _event(self, step: int | None, kind: str, tail_start: int, text: str) -> None:
        self.events.append(LoopEvent(step, kind, tail_start, text))
