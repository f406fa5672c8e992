"""ROK curve: activation peak vs model throughput for Recompute, Offload and Keep.

``tba rok`` (or ``benchmarks/rok_curve.py`` in a checkout) sweeps strategies x micro-batch
sizes on a GPT-2 built from a transformers config and writes ``rok_curve.{csv,json,png}``
with a printed summary. Needs ``transformers`` and, for the figure, ``matplotlib``
(``pip install 'tba[bench]'``).

Strategies: ``keep`` (plain PyTorch: everything stays), ``recompute``
(``torch.utils.checkpoint``, non-reentrant, around every ``GPT2Block``; no tba),
``offload-host``, ``offload-ssd`` (tba, ``offloader="host"``/``"ssd"``, every block but the
kept tail) and ``recompute+offload`` (checkpointing plus the SSD offloader for what is still
saved: the block inputs and the head); ``adaptive`` (tba's default policy) and ``budget``
(``activation_budget_bytes`` at ``--budget-fraction`` of keep's activation peak at the same
batch), both with the SSD offloader on CPU (where host memory is the device) and the host
offloader on CUDA. A strategy whose offloader or option this tba lacks reports an
``unavailable: reason`` row and the sweep goes on.

Method: each sample of a (strategy, batch) point runs in a fresh process (forked from a
forkserver that preloaded torch and transformers): model, AdamW, gradients and optimizer
state are set up, the baseline is taken, then ``--warmup`` steps (a policy strategy: until its
decision holds), for keep and the checkpointing strategies one accounting step, and
``--steps`` measured steps run; a step is forward + backward + optimizer step. A sample's step
time is the median of its measured steps. Every point is sampled ``--repeats`` times in
interleaved passes (Note [Interleaved samples] in ``_schedule``); a point reports median,
mean, min and max over its samples, and each comparison with keep is made per pass, with a
warning when the spread makes it meaningless (Note [When a comparison means nothing] in
``_spread``).

Activation peak (the x-axis). On CUDA the allocator's, for every strategy (Note [The allocator
is the activation axis on CUDA] in ``_allocator``): ``max_memory_allocated()`` in a measured
step (peak reset before it) minus ``memory_allocated()`` after set-up, maximum over the
measured steps; tba's accounting below stays beside it (``counted_activation_peak_bytes``) and
the summary and figure warn where the two differ by more than 10%. On CPU (and as that
accounting; Note [One measure of activation memory] in ``_saved``): the peak, during a step, of the bytes of saved activations held in the training device's memory,
the same quantity for every strategy. tba strategies: the cache's own count
(``stats().peak_resident_bytes``, maximum over the measured steps). keep and the
checkpointing strategies: a counting saved-tensor hook (``SavedActivationMeter``) on the
accounting step, above tba's hooks and inside checkpoint's recomputation. On CPU the
"device" is host memory: the measure counts what the training process holds, not what tba
moved to its host pool or SSD.

Beside it: ``process_rss_peak_bytes``, the process's RSS high-water mark during a measured
step (``VmHWM``, reset before each step through ``/proc/self/clear_refs``; ``ru_maxrss`` where
that is unavailable) minus the RSS after set-up; glibc is told (``mallopt``;
``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``) to serve allocations above 64 KiB with
their own mappings and to return frees at once, so RSS follows live memory. It includes the
step's temporaries and, on CPU, tba's host pool and the SSD offloader's staging buffers. On
CUDA also ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` during a step
minus their values after set-up. Workers run CPU cores - 1 compute threads, leaving a core to
tba's I/O threads as a GPU machine would (with every core computing, the writer starves and
nothing is freed early).

Model FLOPs (``tba.plan.model_flops``), algorithmic work only, recompute not counted:
    model_flops = 3 * (L * (24*b*s*h^2 + 4*b*s^2*h) + 2*b*s*h*V)
(forward matmuls, multiply-add = 2 FLOPs, backward = 2 x forward; L layers, hidden h,
micro-batch b, sequence s, vocabulary V). model_flops_per_s = model_flops / step time;
tokens_per_s = b*s / step time.
"""

from __future__ import annotations

from tba.rok._cli import main
from tba.rok._worker import STRATEGIES

__all__ = ["STRATEGIES", "main"]
