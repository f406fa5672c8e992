"""One point of the ROK curve, run in a fresh process (private module of :mod:`tba.rok`).

``run_point(spec)`` builds the model, the optimizer and the strategy, measures the baseline,
runs warm-up and measured training steps and returns a dict of plain values. ``probe(spec)``
describes the machine. Both are called in a child process forked from a forkserver that
preloaded torch and transformers, so every point starts from a fresh address space.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from typing import Any

from tba.rok._allocator import MemoryStats, activation_columns, memory_stats_for
from tba.rok._rss import StepMemory, configure_malloc
from tba.rok._warmup import Warmup, tail_start

STRATEGIES = ("keep", "recompute", "offload-host", "offload-ssd", "recompute+offload", "adaptive", "budget")
# Fixed strategies name their offloader; the policy strategies (adaptive, budget) take the
# sweep's ``policy_offloader`` (the SSD on CPU, where host memory is the device, else "host").
# keep and recompute run without tba.
_OFFLOADER = {"offload-host": "host", "offload-ssd": "ssd", "recompute+offload": "ssd"}
POLICY_STRATEGIES = ("adaptive", "budget")
CHECKPOINTING = ("recompute", "recompute+offload")
# Strategies whose activation peak the saved-activation meter counts (Note [One measure of
# activation memory] in _saved); the others report their cache's count.
METERED = ("keep", *CHECKPOINTING)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_model(model_spec: dict[str, Any], device: str, dtype: str):  # spec: JSON from the parent
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(
        n_embd=model_spec["hidden"], n_layer=model_spec["layers"], n_head=model_spec["heads"],
        n_positions=model_spec["seq_len"], vocab_size=model_spec["vocab"], activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
        # transformers' GPT2Config signature omits PretrainedConfig's keyword arguments.
        attn_implementation=model_spec.get("attn_implementation", "eager"))  # type: ignore[call-arg]
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a GPU-sized model builds in seconds
        model = GPT2LMHeadModel(cfg)
    # transformers types ``PreTrainedModel.to`` through a wrapper mypy cannot call.
    return model.to(dtype=getattr(torch, dtype)).train()  # type: ignore[call-arg]


def enable_recompute(model, context_fn=None) -> None:
    """``torch.utils.checkpoint`` (non-reentrant) around every ``GPT2Block``; ``context_fn`` as
    checkpoint takes it (the meter's, to count what recomputation saves)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = getattr(model.transformer, "h")
    if not all(getattr(b, "gradient_checkpointing", False) for b in blocks):
        raise RuntimeError("transformers did not enable checkpointing on every GPT2Block")


def _cache_stats_dict(stats) -> dict[str, Any]:
    import dataclasses

    return {f"cache_{k}": v for k, v in dataclasses.asdict(stats).items()}


def run_point(spec: dict[str, Any], memory_stats: MemoryStats | None = None) -> dict[str, Any]:
    """Measure one (strategy, batch size) point. Never raises: errors become a status.

    ``memory_stats``: the allocator whose peak is the activation axis (default: the device's,
    ``memory_stats_for``; tests inject a fake one on the CPU)."""
    try:
        return _run_point(spec, memory_stats)
    except Exception as e:  # a failed point must not stop the sweep; the reason is reported
        tb = traceback.format_exc(limit=6)
        return {"status": f"failed: {type(e).__name__}: {_one_line(e)}", "traceback": tb}


def _one_line(e: object, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cache_options(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The ``configure_tensor_cache`` options of a strategy (None: no tba cache: keep and
    recompute are plain PyTorch).

    Every strategy with a cache manages the same tensors (the sweep's ``min_offload_bytes`` and
    ``keep_last_modules``). The fixed ones offload every block but the kept tail (``adaptive``
    as the sweep says, off by default); ``adaptive`` leaves the policy at tba's defaults;
    ``budget`` adds ``activation_budget_bytes`` (set by the sweep from keep's measured peak).
    """
    strategy, device = spec["strategy"], spec["device"]
    offloader = spec.get("policy_offloader") or ("host" if device == "cuda" else "ssd")
    offloader = _OFFLOADER.get(strategy, offloader)
    if strategy in ("keep", "recompute"):
        return None
    if strategy not in _OFFLOADER and strategy not in POLICY_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    options: dict[str, Any] = dict(offloader=offloader, offload_devices=(device,),
                                   min_offload_bytes=spec["min_offload_bytes"],
                                   keep_last_modules=spec["keep_last_modules"])
    if strategy in _OFFLOADER:
        options["adaptive"] = spec["adaptive"]
    if strategy == "budget":
        if spec.get("activation_budget_bytes") is None:
            raise ValueError("the budget strategy needs activation_budget_bytes in its spec (the sweep sets it "
                             "from keep's activation peak at the same batch)")
        options["activation_budget_bytes"] = int(spec["activation_budget_bytes"])
    if spec.get("ssd_dir") and offloader == "ssd":
        options["ssd_dirs"] = (spec["ssd_dir"],)
    return options


def _decision(cache) -> dict[str, Any]:
    """The policy's last decision, as plain values (empty without one)."""
    decision = getattr(cache, "adaptive_decision", None) if cache is not None else None
    if decision is None:
        return {}
    return {"decision_tail_start": getattr(decision, "tail_start", None),
            "decision_num_blocks": getattr(decision, "num_blocks", None),
            "decision_reason": _one_line(getattr(decision, "reason", ""), 400)}


def deciding(options: dict[str, Any] | None) -> bool:
    """Whether a cache with these options decides what to offload from measured steps (the
    policy strategies, and the fixed ones run with ``--adaptive``)."""
    return options is not None and options["offloader"] != "none" and (
        options.get("adaptive", True) or options.get("activation_budget_bytes") is not None)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _run_point(spec: dict[str, Any], memory_stats: MemoryStats | None) -> dict[str, Any]:
    wall0, cpu0 = time.perf_counter(), _cpu_s()
    malloc = configure_malloc(spec.get("mmap_threshold_bytes")) if spec["device"] == "cpu" else "n/a"
    import torch

    import tba
    from tba import plan
    from tba.rok._saved import SavedActivationMeter

    if spec.get("num_threads"):
        torch.set_num_threads(spec["num_threads"])
    strategy, b, device = spec["strategy"], spec["batch_size"], spec["device"]
    m = spec["model"]
    cuda = device == "cuda"

    model = build_model(m, device, spec["dtype"])
    meter = SavedActivationMeter(model, device) if strategy in METERED else None
    if strategy in CHECKPOINTING:
        enable_recompute(model, meter.checkpoint_contexts if meter is not None else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    # Gradients and optimizer state exist before the baseline, so the peak is activations
    # (and the transient memory of the step), not weights, gradients or Adam moments.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, m["vocab"], (b, m["seq_len"]), generator=g).to(device)

    cache = None
    options = cache_options(spec)
    if options is not None:
        try:
            cache = tba.configure_tensor_cache(model, **options)
        except (ValueError, TypeError, ImportError, NotImplementedError, OSError, tba.TBAError) as e:
            # TypeError: an option this tba does not have (a policy strategy on an older tba)
            return {"status": f"unavailable: {type(e).__name__}: {_one_line(e)}"}

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.item()

    gc.collect()
    # Note [The allocator is the activation axis on CUDA]: the baseline after set-up (weights,
    # gradients, optimizer state and the cache's own set-up).
    memory = StepMemory(memory_stats if memory_stats is not None else memory_stats_for(device))
    memory.take_baseline()
    times, all_stats, tail_starts = [], [], []
    loss = float("nan")
    counted: dict[str, Any] = {}
    warmup = Warmup(spec["warmup_steps"], cache, deciding(options))
    # Note [One measure of activation memory]: the meter counts one untimed step: without a
    # cache (keep, recompute) the last warm-up step (every step saves the same tensors), else
    # one more after the warm-up, when the cache's transfers run as in the measured steps.
    count_in_warmup = meter is not None and cache is None and warmup.steps >= 1
    try:
        i = 0
        while i < warmup.steps:
            with meter.measuring() if meter is not None and count_in_warmup and i == warmup.steps - 1 else contextlib.nullcontext():
                step()
            i += 1
            warmup.after_step(i)
        if cache is not None:
            # The measured steps start from a quiet cache: no store of the warm-up still running
            # (taking CPU from the first measured step) and the offloader sized (its reserve runs
            # on the store worker, which a busy machine may not have run yet).
            cache.wait_for_stores()
        if meter is not None and not count_in_warmup:
            with meter.measuring():
                step()
        if meter is not None:
            counted = {"num_saved_storages": meter.num_storages,
                       **{f"meter_{kind}_bytes": n for kind, n in meter.peak_by_kind.items()}}
        for _ in range(spec["steps"]):
            gc.collect()
            memory.start()
            t0 = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            memory.finish()
            if cache is not None:
                all_stats.append(cache.stats())
                tail_starts.append(tail_start(cache))
        decision = _decision(cache)
    finally:
        if cache is not None:
            cache.close()

    step_time = statistics.median(times)
    shape = plan.ModelShape(arch="gpt", num_layers=m["layers"], hidden_size=m["hidden"], num_heads=m["heads"],
                            seq_len=m["seq_len"], vocab_size=m["vocab"])
    flops = plan.model_flops(shape, b)
    dtype_bytes = torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()
    acc = (plan.Accounting.pytorch_cpu(dtype_bytes=dtype_bytes, dropout=False) if not cuda
           else plan.Accounting(dtype_bytes=dtype_bytes, dropout=False,
                                attention="flash" if m.get("attn_implementation") == "sdpa" else "eager"))
    row: dict[str, Any] = {
        "status": "ok",
        **counted,
        "step_time_s": step_time,
        "model_flops_per_s": flops / step_time,
        "tokens_per_s": b * m["seq_len"] / step_time,
        "model_flops_per_step": flops,
        "step_times_s": times,
        **memory.row(),
        "plan_activation_bytes": plan.activation_bytes(shape, b, acc),
        "loss": loss,
        "malloc": malloc,
        "num_threads": torch.get_num_threads(),
        "warmup_steps_run": warmup.steps,
        "worker_wall_s": time.perf_counter() - wall0,
        "worker_cpu_s": _cpu_s() - cpu0,
    }
    if options is not None:
        row.update(offloader=options["offloader"], adaptive=options.get("adaptive", True), **decision)
        if "activation_budget_bytes" in options:
            row["activation_budget_bytes"] = options["activation_budget_bytes"]
        row["cache_offloaded_bytes_per_step"] = [s.offloaded_bytes for s in all_stats]
        # Stores backward cancelled because it needed the tensor first (on a busy machine,
        # possibly every store of a step): with the bytes offloaded, what the step sent.
        row["cache_num_cancelled_per_step"] = [s.num_cancelled for s in all_stats]
        if any(t is not None for t in tail_starts):
            row["decision_tail_start_per_step"] = tail_starts
        if warmup.unsettled:
            row["decision_unsettled"] = warmup.unsettled
    if all_stats:
        row.update(_cache_stats_dict(all_stats[-1]))
        row["cache_peak_resident_bytes"] = max(s.peak_resident_bytes for s in all_stats)
        row["cache_stall_s"] = statistics.median(s.stall_s for s in all_stats)
        if "activation_budget_bytes" in row:
            row["budget_met"] = row["cache_peak_resident_bytes"] <= row["activation_budget_bytes"]
    # Note [The allocator is the activation axis on CUDA]
    row.update(activation_columns(meter.peak_bytes if meter is not None else row.get("cache_peak_resident_bytes"),
                                  "meter" if meter is not None else "cache", memory.allocator_peak))
    return row


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Describe the machine the points run on (in a child, so the parent never touches CUDA)."""
    import torch
    import transformers

    import tba

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tba": getattr(tba, "__version__", "unknown"),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import psutil

        info["host_memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    if spec.get("device") == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    gpu_count=torch.cuda.device_count())
    return info


def child_main(conn, kind: str, spec: dict[str, Any]) -> None:
    """Entry point of a forked child: run ``kind`` ("point" or "probe"), send the result."""
    log = spec.get("log_path")
    if log:  # warnings and crashes of this point go to its own log, not over the progress bar
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import torch  # noqa: F401 - preloaded by the forkserver: what gc.freeze() below covers

    import tba.plan  # noqa: F401
    import tba.rok._saved  # noqa: F401

    # Everything imported so far lives as long as this process: keep it out of the point's
    # collections (each would otherwise walk torch's and transformers' objects: ~0.4 s on 2
    # cores). Here, not in run_point: frozen garbage of a process that calls run_point itself
    # (the tests) would never be collected.
    gc.freeze()
    try:
        result = probe(spec) if kind == "probe" else run_point(spec)
    except Exception as e:  # probe failures are reported like point failures
        result = {"status": f"failed: {type(e).__name__}: {_one_line(e)}", "traceback": traceback.format_exc()}
    if log and "traceback" in result:
        print(result["traceback"], file=sys.stderr, flush=True)
    conn.send(result)
    conn.close()
