"""Check tba on your own model, and test what you plug into it.

Every activation offloader that silently changed gradients or silently offloaded nothing
shipped because its users could not check their own model. :func:`check_parity` is that check:
it trains your model and a copy configured with tba on the same batches and compares them bit
for bit, failing also when no byte really went out and came back. ``tba check MODULE:FACTORY``
runs it from the command line.

For extenders (a new offloader, a scheduler integration) and tba's own tests:

- :class:`FakeOffloader` keeps bytes in a dict, with gates and injected I/O failures;
  :class:`RecordingStreams` is a stream layer that logs the cache's ordering calls.
- :class:`ChaosOffloader` delays an offloader's transfers at random (``check_parity(...,
  chaos=True)``; tba's suite runs under it with ``pytest -p tests.chaos``).
- :class:`CorruptingOffloader` (one flipped byte on one load) and :class:`ForgetfulOffloader`
  (stores nothing) are what a parity check must catch.
- :func:`initialise_vector_math` makes plain PyTorch on the CPU repeat itself (Note [First VML
  call race]) before any bit-exact comparison of your own.
- :func:`drive_closed_loop` gives a cache's closed loop scripted time: a
  :class:`FakeStepClock` that moves only when the test moves it, the memory free for keep
  steps, the loop's periods. :class:`ScriptedWorld` is a whole world built on it: a small
  model in a real cache whose compute, transfer, noise, outliers and drift are scripted and
  whose best boundary is known, for tests of what the adaptive policy decides.
- :func:`probe` is a read-only view of a cache's insides (entries and their states, the
  running step's records, counters, hooks held); tba's own tests read the cache through it.
- :class:`StorageWatch` tells from outside the cache whether storages were really freed
  (finalizers on the storages of module outputs, saved tensors or a compiled graph's stores),
  where the cache's own count could read low while a stray reference keeps them alive.

``import tba`` does not import this package; import ``tba.testing`` explicitly.

Example:
    >>> from tba.testing import check_parity
    >>> report = check_parity(model, batches, offloader="ssd", force=True)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    tba parity check: PASS (offloader 'ssd', 3 steps)
      losses, gradients, parameters and buffers bit-identical at every step
      offloaded 3.7 MiB, reloaded 3.7 MiB; 57 tensors compared per step
"""

from __future__ import annotations

from tba.testing._broken import CorruptingOffloader, ForgetfulOffloader
from tba.testing._chaos import ChaosOffloader
from tba.testing._determinism import initialise_vector_math
from tba.testing._fakes import FakeOffloader, RecordingStreams
from tba.testing._liveness import StorageWatch
from tba.testing._parity import check_parity
from tba.testing._report import Mismatch, ParityReport
from tba.offloaders.wrapper import OffloaderWrapper
from tba.testing._probe import CacheProbe, probe
from tba.testing._gpu_world import GpuWorld
from tba.testing._scripted_world import ScriptedWorld
from tba.testing._step_timing import FakeStepClock, drive_closed_loop

__all__ = [
    "check_parity",
    "ParityReport",
    "Mismatch",
    "ChaosOffloader",
    "CorruptingOffloader",
    "ForgetfulOffloader",
    "FakeOffloader",
    "RecordingStreams",
    "OffloaderWrapper",
    "initialise_vector_math",
    "probe",
    "CacheProbe",
    "StorageWatch",
    "drive_closed_loop",
    "FakeStepClock",
    "ScriptedWorld",
    "GpuWorld",
]
