"""Feasibility model for activation offloading: how many bytes, how fast, how long an SSD lasts.

For a GPT, BERT, T5 or Llama-style decoder (Llama 2/3, Mistral, Qwen2: RMSNorm, rotary,
grouped-query attention, SwiGLU) and a micro-batch this package estimates

1. **activation bytes per step**: the bytes autograd saves in forward for backward, term by
   term (``activation_terms``), counted the way tba's cache sees them: distinct storages,
   parameters excluded. ``Accounting`` makes explicit which tensors are counted and at what
   width; its defaults are today's LLM recipe (bf16, flash/SDPA attention, no dropout).
   ``Accounting.korthikanti()`` reproduces Korthikanti et al., "Reducing Activation
   Recomputation in Large Transformer Models" (2022), ``s*b*h*(34 + 5*a*s/h)`` bytes per layer
   (fp16, eager attention, 1-byte dropout masks, no norm statistics, no embedding/head);
   ``Accounting.pytorch_cpu()`` matches transformers' models on CPU, which is what the tests
   validate against, in float32 and bfloat16;
2. **model FLOPs per step** (``model_flops``): algorithmic work only, recompute excluded;
3. **required write bandwidth** (``required_write_bandwidth``): offloaded bytes must be
   written within a window of the step (by default half of it) to stay hidden, compared with
   what the target absorbs: SSDs at their sustained (or burst) write speed, or the host link
   for ``offloader="host"``;
4. **SSD lifetime** (``ssd_lifetime_years``) from a drive's endurance rating (PBW, or DWPD x
   capacity x warranty years) and a write-amplification factor.

Example:
    >>> from tba import plan
    >>> gpt2 = plan.PRESETS["gpt2"]
    >>> plan.activation_bytes(gpt2, batch_size=8, accounting=plan.Accounting.korthikanti()) / 2**30
    8.015625
    >>> report = plan.plan(plan.PRESETS["llama3-8b"], 1, peak_flops=989e12, drive=plan.DRIVES["samsung-990pro-2tb"])
    >>> report.bandwidth_ok
    False

Command line: ``tba plan --model llama3-8b --gpu h100 --drive optane-p5800x-1.6tb`` (or
``python -m tba.plan``; ``--help``).
"""

from __future__ import annotations

from tba.plan._cli import main
from tba.plan._estimate import (
    PlanReport,
    activation_bytes,
    activation_terms,
    korthikanti_layer_bytes,
    model_flops,
    plan,
    required_write_bandwidth,
    ssd_lifetime_years,
)
from tba.plan._hardware import DRIVES, GPU_PEAK_FLOPS, HOST_LINKS, Drive, HostLink, measure_host_link
from tba.plan._presets import PRESETS
from tba.plan._report import format_report
from tba.plan._terms import ActivationTerm
from tba.plan._types import Accounting, ModelShape

__all__ = [
    "ModelShape",
    "Accounting",
    "Drive",
    "HostLink",
    "PlanReport",
    "ActivationTerm",
    "PRESETS",
    "DRIVES",
    "HOST_LINKS",
    "GPU_PEAK_FLOPS",
    "activation_terms",
    "activation_bytes",
    "korthikanti_layer_bytes",
    "model_flops",
    "required_write_bandwidth",
    "ssd_lifetime_years",
    "measure_host_link",
    "plan",
    "format_report",
    "main",
]
