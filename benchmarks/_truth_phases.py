"""The phases of gpu_truth.py: which models, batches and strategies it measures, sized to the
device, and the planner's prediction for the configuration it expects to hide."""

from __future__ import annotations

import dataclasses
from typing import Any

from tba import plan

GIB = 2**30
MAIN_GPU_MODEL: dict[str, Any] = dict(layers=12, hidden=2048, heads=16, seq_len=1024, vocab=32768, attn_implementation="sdpa")
TINY_MODEL: dict[str, Any] = dict(layers=2, hidden=64, heads=2, seq_len=64, vocab=128)
HIDE_HIDDEN = (2048, 3072, 4096, 5120, 6144)  # candidates for the configuration the planner expects to hide
HIDE_FRACTION = 0.8


@dataclasses.dataclass
class Phase:
    name: str
    model: dict[str, Any]
    batch: int
    strategies: tuple[str, ...]
    share: float  # of the run's time budget
    snapshot: bool = False
    prediction: dict[str, Any] | None = None


def shape_of(model: dict[str, Any]) -> plan.ModelShape:
    return plan.ModelShape(arch="gpt", num_layers=model["layers"], hidden_size=model["hidden"],
                           num_heads=model["heads"], seq_len=model["seq_len"], vocab_size=model["vocab"])


def accounting(model: dict[str, Any], cuda: bool) -> plan.Accounting:
    if not cuda:
        return plan.Accounting.pytorch_cpu(dtype_bytes=4, dropout=False)
    return plan.Accounting(dtype_bytes=2, dropout=False,
                           attention="flash" if model.get("attn_implementation") == "sdpa" else "eager")


def state_bytes(model: dict[str, Any], cuda: bool) -> int:
    """Weights, gradients and AdamW's two moments of one copy of the model."""
    return shape_of(model).num_parameters * (2 if cuda else 4) * 4


def predict_hide(model: dict[str, Any], batch: int, cuda: bool, host_link: plan.HostLink, peak_flops: float,
                 step_time_s: float | None = None) -> dict[str, Any]:
    """The planner's view of host offloading for ``model`` at ``batch``: the share of the
    activation bytes the host link writes within half the step (the planner's window), at the
    step time given or estimated from ``peak_flops`` at 40% MFU."""
    report = plan.plan(shape_of(model), batch, accounting=accounting(model, cuda), step_time_s=step_time_s,
                       peak_flops=None if step_time_s else peak_flops, offloader="host", host_link=host_link)
    available = report.available_write_bytes_per_s or 0.0
    fraction = min(1.0, available * report.write_window_fraction * report.step_time_s / report.activation_bytes)
    return {"planned_activation_bytes": report.activation_bytes, "step_time_s": report.step_time_s,
            "step_time_source": report.step_time_source, "required_write_bytes_per_s": report.required_write_bytes_per_s,
            "host_link": f"{host_link.name} {host_link.bytes_per_s / 1e9:.1f} GB/s", "fraction_hidden": fraction,
            "bandwidth_ok": report.bandwidth_ok}


def plan_phases(cuda: bool, total_bytes: int, host_link: plan.HostLink, peak_flops: float,
                only: set[str] | None = None) -> tuple[list[Phase], list[str]]:
    """The phases for this device (GPU sizes from its memory; tiny on CPU) and notes on the
    choices. ``only``: phase kinds to keep (main, hide, compiled)."""
    from _truth_run import COMPILED, EAGER

    notes: list[str] = []
    if not cuda:
        main, batches, hide_model, hide_batch = dict(TINY_MODEL), (8, 16), dict(TINY_MODEL, hidden=128), 8
        compiled_model = dict(TINY_MODEL)
    else:
        main = dict(MAIN_GPU_MODEL)
        per_sample = plan.activation_bytes(shape_of(main), 1, accounting(main, True))
        # Every strategy's copy lives through the phase; keep's activations come on top (x1.3
        # for the loss's float32 logits and transients the planner does not count).
        room = 0.85 * total_bytes - len(EAGER) * state_bytes(main, True)
        target = min(28 * GIB, room / 1.3)
        big = max(2, int(target // per_sample))
        batches = (max(1, big // 2), big)
        notes.append(f"main model {main}: planned activations {per_sample / GIB:.2f} GiB per sample; batches "
                     f"{batches} (keep ~{batches[0] * per_sample / GIB:.1f} and ~{big * per_sample / GIB:.1f} GiB)")
        hide_batch, found = 8, None
        for hidden in HIDE_HIDDEN:
            candidate = dict(main, layers=4, hidden=hidden, heads=hidden // 128)
            p = predict_hide(candidate, hide_batch, True, host_link, peak_flops)
            fits = 3 * state_bytes(candidate, True) + 1.5 * p["planned_activation_bytes"] < 0.8 * total_bytes
            if fits:
                found = candidate
                if p["fraction_hidden"] >= HIDE_FRACTION:
                    break
        hide_model = found or dict(main, layers=4)
        compiled_model = dict(main, layers=3)  # Inductor compiles each copy: its time grows with the graph
    phases = [Phase(f"main b{batches[0]}", main, batches[0], EAGER, 0.25, snapshot=True),
              Phase(f"main b{batches[1]}", main, batches[1], EAGER, 0.25),
              Phase("hide", hide_model, hide_batch, ("keep", "host", "defaults"), 0.12),
              Phase("compiled", compiled_model, batches[0], COMPILED, 0.23)]
    phases[2].prediction = predict_hide(hide_model, hide_batch, cuda, host_link, peak_flops)
    notes.append(f"hide model {hide_model} batch {hide_batch}: the planner predicts "
                 f"{phases[2].prediction['fraction_hidden']:.0%} of the activation bytes hidden")
    if only:
        phases = [p for p in phases if p.name.split()[0] in only]
    return phases, notes
