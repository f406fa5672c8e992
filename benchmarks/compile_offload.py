#!/usr/bin/env python
"""Offload inside the compiled graph: the main job's GPT-2, compiled, kept vs ``backend="tba"``.

Strategies, each its own copy of the model from one seed, compiled whole (``fullgraph=True``) but
the ``eager-*`` ones:

- ``keep``: ``torch.compile(model, backend=<inner>)``: every activation stays in memory.
- ``tba-host`` / ``tba-ssd``: ``torch.compile(model, backend="tba")`` with a tensor cache
  offloading to host memory / to SSD: every block but the last (the ROK sweep's fixed offload
  strategies: ``keep_last_modules=1``, its ``min_offload_bytes``, no adaptive policy).
- ``tba-none``: the same with ``offloader="none"``: tba's ops and bookkeeping in the graph,
  no byte moved (what the rewrite itself costs).
- ``eager-keep``, ``eager-none``, ``eager-host``, ``eager-ssd``: the same model and caches
  without ``torch.compile`` (tba's hooks, as a user without compile runs it), their ratios to
  ``eager-keep``: what each offloader costs eager mode on this machine, beside what it costs
  the compiled graph (``tba-none`` against ``keep``, ...). ``eager-keep`` and ``eager-none``
  run by default.
- ``torch-offload``: PyTorch's own pass (``torch._functorch.config.enable_activation_offloading``;
  torch 2.13 lets nothing but a graph pass choose what it offloads, so a joint-graph pass marks
  every forward op, and the pass offloads what it can: no views, contiguous tensors), on CUDA
  with its transfer stream and reload prefetch. On CPU it moves tensors to host memory, which is
  the training memory itself: it runs, and cannot lower anything.

Measured side by side in one run: after warm-up (compilation included), ``--repeats`` rounds of
``--steps`` timed steps per strategy, strategies in a new random order each round; the step time
is the median. The activation peak is the ROK sweep's measure (Note [One measure of activation
memory] in tba/rok/_saved.py) on ``--peak-steps`` more steps per strategy, each measured alone,
the median printed (the JSON keeps each): every storage saved for backward,
counted while it lives in training memory, the compiled graph's stores and reloads included
(``tba.compile.watch``), measured from outside the cache (``weakref.finalize`` on each
storage: it is counted until its memory is really freed). Both are printed as ratios to
``keep``. Beside them: the cache's own count of those steps (``stats().peak_resident_bytes``,
"cache count") and, on CUDA, the allocator's peak over the step minus what was allocated
before it (``torch.cuda.max_memory_allocated``, "allocator"; "-" on CPU).

Command lines (repository root, venv active):

    # The committed CPU figures (benchmarks/results/cpu/compile_offload.txt): the main job's CPU
    # GPT-2 (6 layers x 128 wide, seq 128, vocab 1024), batch 4, Inductor:
    python benchmarks/compile_offload.py --out benchmarks/results/cpu/compile_offload.json
    # On a GPU (the GPT sized to its memory, as `tba rok --device cuda`; bf16):
    python benchmarks/compile_offload.py --device cuda --out results/compile_offload_cuda.json
    # Without Inductor (aot_eager), e.g. to separate tba's cost from Inductor's:
    python benchmarks/compile_offload.py --inner aot_eager
    # Smoke run (tests/benchmarks/test_compile_offload.py):
    python benchmarks/compile_offload.py --quick --inner aot_eager --out /tmp/co.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tba from this checkout when not installed

import torch  # noqa: E402

import tba  # noqa: E402
import tba.compile  # noqa: E402
from _environment import describe  # noqa: E402
from tba.rok._cli import _CPU_MODEL, _QUICK_MODEL, _cpu_threads, _cuda_model  # noqa: E402
from tba.rok._saved import SavedActivationMeter  # noqa: E402
from tba.rok._worker import build_model  # noqa: E402

STRATEGIES = ("keep", "tba-none", "tba-host", "tba-ssd", "torch-offload", "eager-keep",
              "eager-none", "eager-host", "eager-ssd")
DEFAULT_STRATEGIES = STRATEGIES[:7]


@dataclass
class Runner:
    """One strategy's model, compiled, and what its steps measured."""

    name: str
    model: torch.nn.Module
    compiled: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    cache: tba.TensorCache | None = None
    patches: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    times: list[float] = field(default_factory=list)
    peak_bytes: int = 0  # the median of the measured steps' (``peaks``)
    peaks: list[int] = field(default_factory=list)
    peak_cuda_bytes: int | None = None
    counted_peak_bytes: int | None = None  # the cache's own count (stats().peak_resident_bytes)
    status: str = "ok"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (default: "
                        f"{', '.join(DEFAULT_STRATEGIES)})")
    p.add_argument("--inner", choices=tba.compile.INNER_COMPILERS, default="inductor",
                   help="the compiler under every strategy (keep's backend, tba's options['inner'])")
    p.add_argument("--steps", type=int, default=4, help="timed steps per strategy and round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    p.add_argument("--peak-steps", type=int, default=3,
                   help="steps whose activation peak is measured after the timed ones (median reported)")
    p.add_argument("--min-offload-bytes", type=int,
                   help="default as the ROK sweep: 64 KiB on CPU, 1 MiB on CUDA, 16 KiB with --quick")
    p.add_argument("--ssd-dir", help="directory for tba-ssd (default: TBA_SSD_DIR or a temp dir)")
    p.add_argument("--quick", action="store_true", help="a tiny GPT-2 and few steps (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON result (a .txt table beside it)")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown or not args.strategies:
        p.error(f"--strategies: unknown {unknown}; expected some of {', '.join(STRATEGIES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.quick:
        args.steps, args.repeats, args.warmup = min(args.steps, 2), min(args.repeats, 2), min(args.warmup, 2)
        args.peak_steps = min(args.peak_steps, 1)
    if args.peak_steps < 1:
        p.error("--peak-steps: at least 1")
    return args


def _model_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return dict(_QUICK_MODEL)
    if args.device == "cuda":
        return dict(_cuda_model(torch.cuda.get_device_properties(0).total_memory))
    return dict(_CPU_MODEL)


@contextlib.contextmanager
def _torch_offload_patches() -> Iterator[None]:
    """PyTorch's own activation offloading, every forward op a candidate (Note in the module
    docstring): on while this strategy compiles and runs (the compiled graph keeps what it
    was compiled with; the patches are on around every call so a recompile sees them too)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MarkForOffload(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward":
                    node.meta["should_offload"] = True

        def uuid(self) -> Any:
            return None

    cuda = torch.cuda.is_available()
    with functorch_config.patch(enable_activation_offloading=True,
                                activation_offload_separate_stream=cuda,
                                activation_reload_prefetch=cuda), \
            torch._inductor.config.patch(joint_custom_post_pass=MarkForOffload()):
        yield


def _build(name: str, args: argparse.Namespace, spec: dict[str, Any], ssd_dir: str) -> Runner:
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    torch.manual_seed(args.seed)
    model = build_model(spec, args.device, dtype)
    # transformers warns (logging: a graph break under Dynamo) when loss_type is unset.
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kind, _, offloader = name.partition("-")
    if kind in ("tba", "eager") and offloader != "keep":
        min_bytes = args.min_offload_bytes
        if min_bytes is None:
            min_bytes = 16 << 10 if args.quick else 1 << 20 if args.device == "cuda" else 64 << 10
        options: dict[str, Any] = dict(
            offloader=offloader, offload_devices=(args.device,), min_offload_bytes=min_bytes,
            keep_last_modules=1, adaptive=False,
        )
        if offloader == "ssd":
            options.update(ssd_dirs=(ssd_dir,))
        cache = tba.configure_tensor_cache(model, **options)
        if kind == "eager":
            return Runner(name, model, model, optimizer, cache)
        compiled = torch.compile(model, backend="tba", fullgraph=True, options={"inner": args.inner})
        return Runner(name, model, compiled, optimizer, cache)
    if name == "eager-keep":
        return Runner(name, model, model, optimizer)
    if name == "torch-offload" and args.inner != "inductor":
        runner = Runner(name, model, model, optimizer)
        runner.status = "not run: PyTorch's pass is Inductor's partitioner's (--inner inductor)"
        return runner
    compiled = torch.compile(model, backend=args.inner, fullgraph=True)
    patches = _torch_offload_patches if name == "torch-offload" else contextlib.nullcontext
    return Runner(name, model, compiled, optimizer, patches=patches)


def _step(runner: Runner, ids: torch.Tensor, cuda: bool) -> float:
    """One training step; its wall time (the GPU finished)."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with runner.patches():
        loss = runner.compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure_peak(runner: Runner, ids: torch.Tensor, device: str, steps: int) -> None:
    """The peaks of ``steps`` more steps, each measured alone; the median is reported (where
    store threads race the forward, one step's peak varies by 2x from step to step: compiled
    host offload on 2 CPU cores measured 9-20 MiB), the spread kept in the JSON."""
    peaks, counted, allocated = [], [], []
    cuda = device == "cuda"
    for _ in range(steps):
        meter = SavedActivationMeter(runner.model, device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with meter.measuring(), tba.compile.watch(meter.observe):
            _step(runner, ids, cuda)
        peaks.append(meter.peak_bytes)
        if runner.cache is not None:
            counted.append(runner.cache.stats().peak_resident_bytes)
        if cuda:
            allocated.append(torch.cuda.max_memory_allocated() - base)
    runner.peaks = peaks
    runner.peak_bytes = int(statistics.median(peaks))
    if counted:
        runner.counted_peak_bytes = int(statistics.median(counted))
    if allocated:
        runner.peak_cuda_bytes = int(statistics.median(allocated))


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = _model_spec(args)
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(_cpu_threads(args.quick))
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, spec["vocab"], (args.batch_size, spec["seq_len"]), generator=g).to(args.device)
    with tempfile.TemporaryDirectory(prefix="tba_compile_offload_", dir=args.ssd_dir) as ssd_dir:
        runners = [_build(name, args, spec, ssd_dir) for name in args.strategies]
        live = [r for r in runners if r.status == "ok"]
        for runner in live:  # warm-up: compiles, then settles
            try:
                for _ in range(args.warmup):
                    _step(runner, ids, cuda)
            except Exception as exc:  # a strategy that cannot run here is reported, not fatal
                runner.status = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        live = [r for r in live if r.status == "ok"]
        order = random.Random(args.seed)
        for _ in range(args.repeats):
            order.shuffle(live)
            for runner in live:
                runner.times.extend(_step(runner, ids, cuda) for _ in range(args.steps))
        for runner in live:
            _measure_peak(runner, ids, args.device, args.peak_steps)
        result = _report(runners, args, spec)
        for runner in runners:
            if runner.cache is not None:
                runner.cache.close()
    return result


def _report(runners: list[Runner], args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    baselines = {r.name: r for r in runners if r.name in ("keep", "eager-keep") and r.status == "ok"}
    rows: dict[str, Any] = {}
    for r in runners:
        keep = baselines.get("eager-keep" if r.name.startswith("eager-") else "keep")
        row: dict[str, Any] = {"status": r.status}
        if r.status == "ok":
            step_s = statistics.median(r.times)
            row.update(step_s=step_s, peak_bytes=r.peak_bytes, peaks_bytes=r.peaks,
                       steps_timed=len(r.times))
            if r.peak_cuda_bytes is not None:
                row["peak_cuda_allocated_bytes"] = r.peak_cuda_bytes
            if r.counted_peak_bytes is not None:
                row["counted_peak_bytes"] = r.counted_peak_bytes
            if keep is not None:
                row["step_time_ratio"] = step_s / statistics.median(keep.times)
                row["peak_ratio"] = r.peak_bytes / keep.peak_bytes if keep.peak_bytes else None
            if r.cache is not None:
                stats = r.cache.stats(cumulative=True)
                row["offloaded_bytes_per_step"] = stats.offloaded_bytes // max(stats.num_steps, 1)
                row["reloaded_bytes_per_step"] = stats.reloaded_bytes // max(stats.num_steps, 1)
        rows[r.name] = row
    return {"environment": describe(args.device), "model": spec, "batch_size": args.batch_size,
            "inner": args.inner, "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
            "strategies": rows}


def _table(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [" ".join(f"{k}={v}" for k, v in env.items()),
             f"model={result['model']} batch={result['batch_size']} inner={result['inner']} "
             f"timed={result['repeats']}x{result['steps']} steps per strategy (interleaved)",
             f"{'strategy':<15}{'step s':>9}{'x keep':>8}{'act peak MiB':>14}{'x keep':>8}"
             f"{'cache count MiB':>17}{'allocator MiB':>15}{'offloaded MiB/step':>20}  status"]
    for name, row in result["strategies"].items():
        if row["status"] != "ok":
            lines.append(f"{name:<15}{'':>91}  {row['status']}")
            continue
        ratio_t = row.get("step_time_ratio")
        ratio_m = row.get("peak_ratio")
        offloaded = row.get("offloaded_bytes_per_step")
        lines.append(
            f"{name:<15}{row['step_s']:>9.3f}{ratio_t if ratio_t is not None else float('nan'):>8.2f}"
            f"{row['peak_bytes'] / 2**20:>14.2f}{ratio_m if ratio_m is not None else float('nan'):>8.2f}"
            f"{_mib(row.get('counted_peak_bytes')):>17}{_mib(row.get('peak_cuda_allocated_bytes')):>15}"
            f"{(offloaded or 0) / 2**20:>20.2f}  ok"
        )
    if any(name.startswith("eager-") for name in result["strategies"]):
        lines.append("x keep: eager-* rows against eager-keep (no torch.compile), the others "
                     "against keep (compiled)")
    return "\n".join(lines) + "\n"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = run(args)
    text = _table(result)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
