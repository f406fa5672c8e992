"""Feasibility model for activation offloading: how many bytes, how fast, how long an SSD lasts.

For a GPT, BERT or T5 shape and a micro-batch this module estimates

1. **activation bytes per step**: the bytes autograd saves in forward for backward, term by
   term (``activation_terms``), counted the way tba's cache sees them: distinct storages,
   parameters excluded. ``Accounting`` makes explicit which tensors are counted and at what
   width. ``Accounting.korthikanti()`` reproduces Korthikanti et al., "Reducing Activation
   Recomputation in Large Transformer Models" (2022), ``s*b*h*(34 + 5*a*s/h)`` bytes per layer
   (fp16 activations, 1-byte dropout masks, no layer-norm statistics, no embedding/head);
   ``Accounting.pytorch_cpu()`` matches eager PyTorch on CPU in float32 (dropout saves a
   float noise tensor, not a bool mask), which is what the tests validate against;
2. **model FLOPs per step** (``model_flops``): algorithmic work only, recompute excluded;
3. **required write bandwidth** (``required_write_bandwidth``): offloaded bytes must be
   written within a window of the step (by default half of it) to stay hidden;
4. **SSD lifetime** (``ssd_lifetime_years``) from a drive's endurance rating (PBW, or DWPD x
   capacity x warranty years) and a write-amplification factor.

Example:
    >>> from tba import plan
    >>> gpt2 = plan.PRESETS["gpt2"]
    >>> plan.activation_bytes(gpt2, batch_size=8, accounting=plan.Accounting.korthikanti()) / 2**30
    8.015625
    >>> report = plan.plan(gpt2, batch_size=8, step_time_s=0.5, drive=plan.DRIVES["samsung-990pro-2tb"])

Command line: ``python -m tba.plan --model gpt3-175b --batch-size 1 --gpu h100`` (``--help``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tba._plan_terms import ActivationTerm, model_terms
from tba._plan_types import Accounting, Drive, ModelShape

__all__ = [
    "ModelShape",
    "Accounting",
    "Drive",
    "PlanReport",
    "ActivationTerm",
    "PRESETS",
    "DRIVES",
    "GPU_PEAK_FLOPS",
    "activation_terms",
    "activation_bytes",
    "korthikanti_layer_bytes",
    "model_flops",
    "required_write_bandwidth",
    "ssd_lifetime_years",
    "plan",
    "format_report",
    "main",
]

_SECONDS_PER_YEAR = 365 * 86400


def _gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 50257) -> ModelShape:
    return ModelShape(arch="gpt", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq,
                      vocab_size=vocab)


# Shapes of public checkpoints (no weights are needed).
PRESETS: dict[str, ModelShape] = {
    "gpt2": _gpt(12, 768, 12, 1024),
    "gpt2-medium": _gpt(24, 1024, 16, 1024),
    "gpt2-large": _gpt(36, 1280, 20, 1024),
    "gpt2-xl": _gpt(48, 1600, 25, 1024),
    "gpt3-2.7b": _gpt(32, 2560, 32),
    "gpt3-13b": _gpt(40, 5120, 40),
    "gpt3-175b": _gpt(96, 12288, 96),
    "bert-base": ModelShape(arch="bert", num_layers=12, hidden_size=768, num_heads=12, seq_len=512, vocab_size=30522),
    "bert-large": ModelShape(arch="bert", num_layers=24, hidden_size=1024, num_heads=16, seq_len=512,
                             vocab_size=30522),
    "t5-small": ModelShape(arch="t5", num_layers=6, hidden_size=512, num_heads=8, seq_len=512, vocab_size=32128),
    "t5-base": ModelShape(arch="t5", num_layers=12, hidden_size=768, num_heads=12, seq_len=512, vocab_size=32128),
    "t5-large": ModelShape(arch="t5", num_layers=24, hidden_size=1024, num_heads=16, seq_len=512, vocab_size=32128),
    "t5-3b": ModelShape(arch="t5", num_layers=24, hidden_size=1024, num_heads=32, head_dim=128, ffn_size=16384,
                        seq_len=512, vocab_size=32128),
}

# Nominal datasheet ratings; check your own drive's.
DRIVES: dict[str, Drive] = {
    "optane-p5800x-1.6tb": Drive(name="Intel Optane P5800X 1.6 TB", capacity_bytes=1_600_000_000_000, dwpd=100,
                                 warranty_years=5, write_bytes_per_s=6.2e9),
    "samsung-990pro-2tb": Drive(name="Samsung 990 PRO 2 TB", capacity_bytes=2_000_000_000_000, pbw=1.2,
                                warranty_years=5, write_bytes_per_s=6.9e9),
    "enterprise-3dwpd-3.2tb": Drive(name="generic enterprise TLC 3.2 TB, 3 DWPD",
                                    capacity_bytes=3_200_000_000_000, dwpd=3, warranty_years=5),
    "enterprise-1dwpd-7.68tb": Drive(name="generic enterprise TLC 7.68 TB, 1 DWPD",
                                     capacity_bytes=7_680_000_000_000, dwpd=1, warranty_years=5),
}

# Dense fp16/bf16 tensor-core peak per GPU, FLOP/s.
GPU_PEAK_FLOPS: dict[str, float] = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "b200": 2250e12}


def activation_terms(shape: ModelShape, batch_size: int, accounting: Accounting | None = None) -> list[ActivationTerm]:
    """Each saved tensor of one forward pass (see ``tba._plan_terms`` for the notation)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return model_terms(shape, batch_size, accounting or Accounting())


def activation_bytes(shape: ModelShape, batch_size: int, accounting: Accounting | None = None) -> int:
    """Bytes autograd saves for backward in one step of ``shape`` at micro-batch ``batch_size``.

    Example:
        >>> activation_bytes(PRESETS["gpt2"], 1, Accounting.korthikanti()) == 12 * korthikanti_layer_bytes(
        ...     seq_len=1024, batch_size=1, hidden_size=768, num_heads=12)
        True
    """
    return sum(t.total_bytes for t in activation_terms(shape, batch_size, accounting))


def korthikanti_layer_bytes(*, seq_len: int, batch_size: int, hidden_size: int, num_heads: int) -> int:
    """``s*b*h*(34 + 5*a*s/h)``: bytes one GPT layer saves at fp16 (Korthikanti et al. 2022, eq. 1)."""
    s, b, h, a = seq_len, batch_size, hidden_size, num_heads
    return 34 * s * b * h + 5 * a * s * s * b


def _layer_flops(T: int, T_kv: int, b: int, s_q: int, s_kv: int, h: int, i: int, f: int, cross: bool) -> int:
    proj = 2 * T * h * i * 2 + 2 * T_kv * h * i * 2 if cross else 2 * T * h * 3 * i + 2 * T * i * h
    return proj + 4 * b * s_q * s_kv * i + 4 * T * h * f * (0 if cross else 1)


def model_flops(shape: ModelShape, batch_size: int) -> int:
    """Algorithmic FLOPs of one training step (forward + backward), recompute not counted.

    ``3 x forward``, backward being twice forward. Forward counts matmuls only (multiply-add =
    2 FLOPs): per layer ``2*T*h*3i + 2*T*i*h`` (projections) ``+ 4*b*s^2*i`` (scores and
    probabilities x values, causal masking not discounted) ``+ 4*T*h*f`` (MLP), plus the LM head
    ``2*T*h*V`` (BERT adds its ``2*T*h^2`` transform). With ``i = h`` and ``f = 4h`` a layer is
    ``24*T*h^2 + 4*b*s^2*h``, as in Narayanan et al. (2021). T5 decoder layers add cross
    attention (q/o over decoder tokens, k/v over encoder tokens).
    """
    b, s, h, i, f, V = batch_size, shape.seq_len, shape.hidden_size, shape.attention_width, shape.ffn_size, shape.vocab_size
    T = b * s
    fwd = shape.num_layers * _layer_flops(T, T, b, s, s, h, i, f, False)
    if shape.arch == "t5":
        sd = shape.decoder_seq_len
        Td = b * sd
        fwd += shape.num_decoder_layers * (_layer_flops(Td, Td, b, sd, sd, h, i, f, False)
                                           + _layer_flops(Td, T, b, sd, s, h, i, f, True))
        fwd += 2 * Td * h * V
    else:
        fwd += 2 * T * h * V + (2 * T * h * h if shape.arch == "bert" else 0)
    return 3 * fwd


def required_write_bandwidth(write_bytes: float, step_time_s: float, *, write_window_fraction: float = 0.5) -> float:
    """Bytes/s needed to write ``write_bytes`` within ``write_window_fraction`` of a step.

    Writes are hidden only if they finish while compute still runs; tba's default budget is half
    the step (forward is about a third of it, and the first backward layers need no reads).
    """
    if step_time_s <= 0 or not 0 < write_window_fraction <= 1:
        raise ValueError(f"need step_time_s > 0 and 0 < write_window_fraction <= 1, got {step_time_s}, "
                         f"{write_window_fraction}")
    return write_bytes / (write_window_fraction * step_time_s)


def ssd_lifetime_years(write_bytes_per_step: float, step_time_s: float, drive: Drive, *, num_drives: int = 1,
                       write_amplification: float = 1.0, duty_cycle: float = 1.0) -> float:
    """Years until ``num_drives`` striped drives reach their rated endurance.

    ``years = endurance_bytes / (write_bytes_per_step / step_time_s / num_drives * write_amplification
    * duty_cycle * seconds_per_year)``. ``write_amplification`` scales host writes relative to the
    rating's workload (1.0: as rated; large sequential writes are usually no worse);
    ``duty_cycle`` is the fraction of the time spent training.
    """
    if step_time_s <= 0 or num_drives < 1 or write_amplification <= 0 or not 0 < duty_cycle <= 1:
        raise ValueError("need step_time_s > 0, num_drives >= 1, write_amplification > 0, 0 < duty_cycle <= 1")
    per_drive_bytes_per_s = write_bytes_per_step / step_time_s / num_drives * write_amplification * duty_cycle
    if per_drive_bytes_per_s == 0:
        return math.inf
    return drive.endurance_bytes / (per_drive_bytes_per_s * _SECONDS_PER_YEAR)


@dataclass(frozen=True)
class PlanReport:
    """Everything ``plan`` computed; ``format_report`` renders it as a table."""

    shape: ModelShape
    batch_size: int
    accounting: Accounting
    terms: list[ActivationTerm]
    activation_bytes: int
    model_flops: int
    step_time_s: float
    step_time_source: str
    offload_fraction: float
    write_bytes_per_step: float
    write_window_fraction: float
    required_write_bytes_per_s: float
    drive: Drive | None
    num_drives: int
    write_amplification: float
    duty_cycle: float
    available_write_bytes_per_s: float | None
    lifetime_years: float | None
    korthikanti_bytes: int | None = None

    @property
    def bandwidth_ok(self) -> bool | None:
        """Whether the drives can absorb the writes in the window (None: drive speed unknown)."""
        if self.available_write_bytes_per_s is None:
            return None
        return self.available_write_bytes_per_s >= self.required_write_bytes_per_s


def plan(shape: ModelShape, batch_size: int, *, accounting: Accounting | None = None, step_time_s: float | None = None,
         peak_flops: float | None = None, mfu: float = 0.4, drive: Drive | None = None, num_drives: int = 1,
         write_amplification: float = 1.0, duty_cycle: float = 1.0, offload_fraction: float = 1.0,
         write_window_fraction: float = 0.5, drive_write_bytes_per_s: float | None = None) -> PlanReport:
    """The whole feasibility estimate for one configuration.

    The step time is ``step_time_s`` if given, else ``model_flops / (peak_flops * mfu)``.
    ``offload_fraction`` is the share of activations written (adaptive offloading keeps the tail).
    """
    acc = accounting or Accounting()
    if step_time_s is None and peak_flops is None:
        raise ValueError("give step_time_s, or peak_flops (and mfu) to estimate it")
    if not 0 <= offload_fraction <= 1:
        raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
    terms = activation_terms(shape, batch_size, acc)
    total = sum(t.total_bytes for t in terms)
    flops = model_flops(shape, batch_size)
    if step_time_s is None:
        if not peak_flops > 0 or not 0 < mfu <= 1:
            raise ValueError(f"need peak_flops > 0 and 0 < mfu <= 1, got {peak_flops}, {mfu}")
        step_time_s, source = flops / (peak_flops * mfu), f"{flops:.3g} FLOP / ({peak_flops:.3g} FLOP/s x MFU {mfu})"
    else:
        source = "given"
    write_bytes = total * offload_fraction
    speed = drive_write_bytes_per_s or (drive.write_bytes_per_s if drive else None)
    korth = None
    if shape.arch == "gpt":
        korth = shape.num_layers * korthikanti_layer_bytes(
            seq_len=shape.seq_len, batch_size=batch_size, hidden_size=shape.hidden_size, num_heads=shape.num_heads)
    return PlanReport(
        shape=shape, batch_size=batch_size, accounting=acc, terms=terms, activation_bytes=total, model_flops=flops,
        step_time_s=step_time_s, step_time_source=source, offload_fraction=offload_fraction,
        write_bytes_per_step=write_bytes, write_window_fraction=write_window_fraction,
        required_write_bytes_per_s=required_write_bandwidth(write_bytes, step_time_s,
                                                            write_window_fraction=write_window_fraction),
        drive=drive, num_drives=num_drives, write_amplification=write_amplification, duty_cycle=duty_cycle,
        available_write_bytes_per_s=speed * num_drives if speed else None,
        lifetime_years=ssd_lifetime_years(write_bytes, step_time_s, drive, num_drives=num_drives,
                                          write_amplification=write_amplification, duty_cycle=duty_cycle)
        if drive else None,
        korthikanti_bytes=korth,
    )


def format_report(report: PlanReport, *, show_terms: bool = True) -> str:
    """A readable table of ``report`` (what ``python -m tba.plan`` prints)."""
    from tba._plan_cli import format_report as _format

    return _format(report, show_terms=show_terms)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m tba.plan --help``)."""
    from tba._plan_cli import main as _main

    return _main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
