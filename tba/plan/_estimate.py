"""The estimate of :mod:`tba.plan`: bytes, FLOPs, bandwidth, lifetime (private module)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tba.plan._hardware import Drive, DriveWrite, HostLink
from tba.plan._terms import ActivationTerm, model_terms
from tba.plan._types import Accounting, ModelShape

__all__ = [
    "PlanReport",
    "activation_terms",
    "activation_bytes",
    "korthikanti_layer_bytes",
    "model_flops",
    "required_write_bandwidth",
    "ssd_lifetime_years",
    "plan",
]

_SECONDS_PER_YEAR = 365 * 86400
Offloader = Literal["ssd", "host"]


def activation_terms(shape: ModelShape, batch_size: int, accounting: Accounting | None = None) -> list[ActivationTerm]:
    """Each saved tensor of one forward pass (see ``tba.plan._terms`` for the notation)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return model_terms(shape, batch_size, accounting or Accounting())


def activation_bytes(shape: ModelShape, batch_size: int, accounting: Accounting | None = None) -> int:
    """Bytes autograd saves for backward in one step of ``shape`` at micro-batch ``batch_size``.

    Example:
        >>> from tba.plan import PRESETS
        >>> activation_bytes(PRESETS["gpt2"], 1, Accounting.korthikanti()) == 12 * korthikanti_layer_bytes(
        ...     seq_len=1024, batch_size=1, hidden_size=768, num_heads=12)
        True
    """
    return sum(t.total_bytes for t in activation_terms(shape, batch_size, accounting))


def korthikanti_layer_bytes(*, seq_len: int, batch_size: int, hidden_size: int, num_heads: int) -> int:
    """``s*b*h*(34 + 5*a*s/h)``: bytes one GPT layer saves at fp16 (Korthikanti et al. 2022, eq. 1)."""
    s, b, h, a = seq_len, batch_size, hidden_size, num_heads
    return 34 * s * b * h + 5 * a * s * s * b


def _layer_flops(T: int, T_kv: int, b: int, s_q: int, s_kv: int, h: int, i: int, i_kv: int, mlp: int,
                 cross: bool) -> int:
    """Forward matmul FLOPs of one attention (+ MLP) layer; ``mlp`` is ``h*f`` times the MLP's matrices."""
    if cross:  # q and o over the decoder tokens, k and v over the encoder's
        return 2 * T * h * i * 2 + 2 * T_kv * h * i * 2 + 4 * b * s_q * s_kv * i
    return 2 * T * h * (i + 2 * i_kv) + 2 * T * i * h + 4 * b * s_q * s_kv * i + 2 * T * mlp


def model_flops(shape: ModelShape, batch_size: int) -> int:
    """Algorithmic FLOPs of one training step (forward + backward), recompute not counted.

    ``3 x forward``, backward being twice forward. Forward counts matmuls only (multiply-add =
    2 FLOPs): per layer ``2*T*h*(i + 2*i_kv) + 2*T*i*h`` (projections) ``+ 4*b*s^2*i`` (scores
    and probabilities x values, causal masking not discounted) ``+ 4*T*h*f`` (MLP; ``6*T*h*f``
    for SwiGLU's three matrices), plus the LM head ``2*T*h*V`` (BERT adds its ``2*T*h^2``
    transform). With ``i = i_kv = h`` and ``f = 4h`` a layer is ``24*T*h^2 + 4*b*s^2*h``, as in
    Narayanan et al. (2021). T5 decoder layers add cross attention (q/o over decoder tokens,
    k/v over encoder tokens).
    """
    b, s, h, i, f, V = batch_size, shape.seq_len, shape.hidden_size, shape.attention_width, shape.ffn_size, shape.vocab_size
    i_kv = shape.kv_width
    mlp = (3 if shape.activation == "swiglu" else 2) * h * f
    T = b * s
    fwd = shape.num_layers * _layer_flops(T, T, b, s, s, h, i, i_kv, mlp, False)
    if shape.arch == "t5":
        sd = shape.decoder_seq_len
        Td = b * sd
        fwd += shape.num_decoder_layers * (_layer_flops(Td, Td, b, sd, sd, h, i, i_kv, mlp, False)
                                           + _layer_flops(Td, T, b, sd, s, h, i, i_kv, mlp, True))
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
    """Everything ``plan`` computed; ``format_report`` renders it as a table.

    ``available_write_bytes_per_s`` is what the offload target absorbs: the drives' sustained
    (or burst, ``drive_write``) speed times ``num_drives`` for ``offloader="ssd"``, capped by
    the host link if one is given; the host link for ``offloader="host"``.
    ``bandwidth_source`` says which figure that is.
    """

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
    offloader: Offloader
    drive: Drive | None
    drive_write: DriveWrite
    num_drives: int
    host_link: HostLink | None
    write_amplification: float
    duty_cycle: float
    available_write_bytes_per_s: float | None
    bandwidth_source: str
    lifetime_years: float | None
    korthikanti_bytes: int | None = None

    @property
    def bandwidth_ok(self) -> bool | None:
        """Whether the target absorbs the writes in the window (None: its speed is unknown)."""
        if self.available_write_bytes_per_s is None:
            return None
        return self.available_write_bytes_per_s >= self.required_write_bytes_per_s


def _available(offloader: Offloader, drive: Drive | None, drive_write: DriveWrite, num_drives: int,
               drive_write_bytes_per_s: float | None, host_link: HostLink | None) -> tuple[float | None, str]:
    if offloader == "host":
        if host_link is None:
            return None, "host link unknown: give host_link (a PCIe generation, a rate or a measurement)"
        return host_link.bytes_per_s, f"host link {host_link.name}"
    speed = drive.write_bytes_per_s(drive_write) if drive is not None else None
    if drive_write_bytes_per_s is not None:
        speed, what = drive_write_bytes_per_s, "given write speed"
    elif drive is not None and speed is not None:
        what = f"{drive_write} write of {drive.name}"
    else:
        return None, "drive write speed unknown"
    total, source = speed * num_drives, f"{num_drives} x {what}"
    if host_link is not None and host_link.bytes_per_s < total:
        return host_link.bytes_per_s, f"host link {host_link.name} (slower than {source})"
    return total, source


def plan(shape: ModelShape, batch_size: int, *, accounting: Accounting | None = None, step_time_s: float | None = None,
         peak_flops: float | None = None, mfu: float = 0.4, offloader: Offloader = "ssd", drive: Drive | None = None,
         drive_write: DriveWrite = "sustained", num_drives: int = 1, host_link: HostLink | None = None,
         write_amplification: float = 1.0, duty_cycle: float = 1.0, offload_fraction: float = 1.0,
         write_window_fraction: float = 0.5, drive_write_bytes_per_s: float | None = None) -> PlanReport:
    """The whole feasibility estimate for one configuration.

    The step time is ``step_time_s`` if given, else ``model_flops / (peak_flops * mfu)``.
    ``offload_fraction`` is the share of activations written (adaptive offloading keeps the tail).
    ``offloader`` is where they go: ``"ssd"`` (``drive`` x ``num_drives`` at the drive's
    ``drive_write`` speed, see Note [sustained vs burst drive writes]; the SSD lifetime is
    computed) or ``"host"`` (pinned host memory through ``host_link``).

    Example:
        >>> from tba import plan as P
        >>> r = P.plan(P.PRESETS["llama3-8b"], 1, peak_flops=989e12, drive=P.DRIVES["samsung-990pro-2tb"])
        >>> r.bandwidth_source
        '1 x sustained write of Samsung 990 PRO 2 TB'
    """
    acc = accounting or Accounting()
    problems = []
    if step_time_s is None and peak_flops is None:
        problems.append("give step_time_s, or peak_flops (and mfu) to estimate it")
    if not 0 <= offload_fraction <= 1:
        problems.append(f"offload_fraction must be in [0, 1], got {offload_fraction}")
    if offloader not in ("ssd", "host"):
        problems.append(f"offloader must be 'ssd' or 'host', got {offloader!r}")
    if drive_write not in ("sustained", "burst"):
        problems.append(f"drive_write must be 'sustained' or 'burst', got {drive_write!r}")
    if not isinstance(num_drives, int) or num_drives < 1:
        problems.append(f"num_drives must be a positive int, got {num_drives!r}")
    if drive_write_bytes_per_s is not None and not drive_write_bytes_per_s > 0:
        problems.append(f"drive_write_bytes_per_s must be positive, got {drive_write_bytes_per_s}")
    if step_time_s is None and peak_flops is not None and (not peak_flops > 0 or not 0 < mfu <= 1):
        problems.append(f"need peak_flops > 0 and 0 < mfu <= 1, got {peak_flops}, {mfu}")
    if problems:
        raise ValueError("invalid plan() arguments:\n  - " + "\n  - ".join(problems))
    terms = activation_terms(shape, batch_size, acc)
    total = sum(t.total_bytes for t in terms)
    flops = model_flops(shape, batch_size)
    if step_time_s is not None:
        source = "given"
    else:
        assert peak_flops is not None  # one of the two is given (checked above)
        step_time_s, source = flops / (peak_flops * mfu), f"{flops:.3g} FLOP / ({peak_flops:.3g} FLOP/s x MFU {mfu})"
    write_bytes = total * offload_fraction
    available, bandwidth_source = _available(offloader, drive, drive_write, num_drives, drive_write_bytes_per_s,
                                             host_link)
    korth = None
    if shape.arch == "gpt":
        korth = shape.num_layers * korthikanti_layer_bytes(
            seq_len=shape.seq_len, batch_size=batch_size, hidden_size=shape.hidden_size, num_heads=shape.num_heads)
    lifetime_years = None
    if offloader == "ssd" and drive is not None:
        lifetime_years = ssd_lifetime_years(write_bytes, step_time_s, drive, num_drives=num_drives,
                                            write_amplification=write_amplification, duty_cycle=duty_cycle)
    return PlanReport(
        shape=shape, batch_size=batch_size, accounting=acc, terms=terms, activation_bytes=total, model_flops=flops,
        step_time_s=step_time_s, step_time_source=source, offload_fraction=offload_fraction,
        write_bytes_per_step=write_bytes, write_window_fraction=write_window_fraction,
        required_write_bytes_per_s=required_write_bandwidth(write_bytes, step_time_s,
                                                            write_window_fraction=write_window_fraction),
        offloader=offloader, drive=drive if offloader == "ssd" else None, drive_write=drive_write,
        num_drives=num_drives, host_link=host_link, write_amplification=write_amplification, duty_cycle=duty_cycle,
        available_write_bytes_per_s=available, bandwidth_source=bandwidth_source,
        lifetime_years=lifetime_years,
        korthikanti_bytes=korth,
    )
