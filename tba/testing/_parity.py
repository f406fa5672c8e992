"""`check_parity`: train a model and a copy of it configured with tba on the same batches, and
compare them bit for bit."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

import tba
from tba import offloaders
from tba.testing._audit import AuditedOffloader
from tba.testing._chaos import ChaosOffloader
from tba.testing._determinism import initialise_vector_math
from tba.testing._inputs import LossFn, OptimizerFactory, checked_loss, clone_tensors, default_loss, optimizer_factory
from tba.testing._report import Mismatch, ParityReport, compare
from tba.testing._rng import rng_restored, seed_all
from tba.testing._sanitizer import stream_sanitizer

__all__ = ["check_parity"]

logger = logging.getLogger(__name__)

# What force=True sets: every saved tensor goes out (no size floor, no adaptive choice, no kept
# tail, no budget choosing fewer blocks).
_FORCED: dict[str, Any] = {
    "min_offload_bytes": 0,
    "adaptive": False,
    "keep_last_modules": 0,
    "activation_budget_bytes": None,
}


def check_parity(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    force: bool = False,
    chaos: bool = False,
    chaos_max_delay_s: float = 0.03,
    sanitize: bool | None = None,
    seed: int = 0,
    store_timeout_s: float = 60.0,
    compile: str | None = None,
    compile_options: dict[str, Any] | None = None,
    **cache_options: Any,
) -> ParityReport:
    """Check that tba trains ``model`` bit-identically to plain PyTorch, on your own model.

    ``model`` is deep-copied into a twin configured with
    ``tba.configure_tensor_cache(twin, **cache_options)``; both are trained (``train()`` mode),
    one step per batch, from the same state, with every random generator (torch on CPU and
    CUDA, ``random``, numpy) reseeded identically before each step. After each backward the
    losses and every gradient are compared with ``torch.equal``, after each optimizer step every
    parameter and buffer; the run stops at the first difference. After each forward of the twin
    the check waits for its stores to complete (at most ``store_timeout_s``), so backward reads
    the offloaded bytes back instead of finding them still in memory, and the offloader is
    audited so that it cannot pass without really moving them (it must copy the bytes out: it
    sees a private copy of each source that is overwritten once its store returns, and
    poisoned load buffers).

    The report is ``ok`` only when everything was equal *and* bytes went out and came back: a
    run in which nothing was offloaded (tensors under ``min_offload_bytes``, a device missing
    from ``offload_devices``, a policy keeping every block) proves nothing and fails, saying
    why (``offloader="none"`` aside). Plain PyTorch on the CPU is first made to repeat itself
    (:func:`initialise_vector_math`). On CUDA, kernels that are not deterministic (atomic adds)
    make plain PyTorch differ from itself: use ``torch.use_deterministic_algorithms(True)``.

    Args:
        model: the model to check. It is the reference run: it is trained by the check (its
            parameters and buffers change, it is left in ``train()`` mode); its copy with tba is
            discarded.
        batches: one per training step: a tuple (or list) of positional arguments, a dict of
            keyword arguments, or a lone tensor; on the model's device.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``: runs the forward and returns the
            loss. Default: ``model(*batch)`` / ``model(**batch)`` / ``model(batch)``, and its
            output's ``.loss`` (Hugging Face models given labels), or the output itself when it
            is a one-element tensor.
        optimizer: a factory ``params -> torch.optim.Optimizer``, called once per model.
            Default: ``torch.optim.AdamW`` with its defaults.
        force: send every saved tensor out: ``min_offload_bytes=0``, ``adaptive=False``,
            ``keep_last_modules=0``, no ``activation_budget_bytes``, and unless given,
            ``offload_devices`` = the model's device types (so a CPU model is offloaded).
        chaos: delay every transfer by a random 0 to ``chaos_max_delay_s`` seconds
            (:class:`ChaosOffloader`), so they complete in orders a fast machine never shows.
        chaos_max_delay_s: the longest chaos delay.
        sanitize: run the twin under PyTorch's CUDA stream sanitizer (Note [Stream sanitizer]).
            Default: with ``chaos`` on a CUDA model.
        seed: the random generators are seeded with ``seed + step``.
        store_timeout_s: the longest wait for the twin's stores after each forward.
        compile: ``"tba"``: check a compiled model: the twin runs
            ``torch.compile(twin, backend="tba", options=compile_options)`` (tba's offload
            inside the compiled graph), the reference the same model compiled by the inner
            compiler alone (``backend="inductor"``, or ``compile_options["inner"]``). A model
            already compiled with ``backend="tba"`` (``torch.compile(model, backend="tba")``)
            is checked so without it. None: eager.
        compile_options: ``options`` of the twin's ``torch.compile`` (``{"inner":
            "aot_eager"}`` compiles without Inductor).
        **cache_options: options of :func:`tba.configure_tensor_cache` for the twin (for
            example ``offloader="ssd"``, ``ssd_dirs=...``, ``offload_devices=("cpu",)``).

    Returns:
        The :class:`ParityReport` (``print`` it).

    Raises:
        ValueError: invalid options (every problem at once), no batches, a batch or output
            it cannot use. An exception raised by the model with tba only (an index out of
            range from corrupted token ids, ``tba.OffloadIOError`` from a checksum mismatch, a
            store timeout) is not raised: it is the report's ``error``.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from tba.testing import check_parity
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256))
        >>> ids = [torch.randint(0, 256, (2, 32)) for _ in range(3)]
        >>> report = check_parity(model, [{"input_ids": x, "labels": x} for x in ids],
        ...                       offloader="host", force=True)
        >>> report.ok
        True
    """
    batches = list(batches)
    model, compile = _uncompiled(model, compile)
    devices = _device_types(model)
    options = _resolve_options(cache_options, force, devices, chaos_max_delay_s, store_timeout_s)
    config = tba.TensorCacheConfig(**options)
    make_optimizer = optimizer_factory(optimizer)
    if not batches:
        raise ValueError("tba.testing.check_parity: no batches: pass one batch per training step to compare")
    if sanitize is None:
        sanitize = chaos and "cuda" in devices
    elif sanitize and "cuda" not in devices:
        raise ValueError(
            f"tba.testing.check_parity: sanitize=True needs a model on CUDA (the stream "
            f"sanitizer checks CUDA streams), but the model is on {sorted(devices)}"
        )
    loss_of = loss_fn if loss_fn is not None else default_loss

    initialise_vector_math()  # Note [First VML call race]
    twin = copy.deepcopy(model)
    model.train()
    twin.train()
    optimizers = (make_optimizer(list(model.parameters())), make_optimizer(list(twin.parameters())))
    inner = offloaders.make_offloader(config, rank=_rank())
    if inner is not None:
        chained = ChaosOffloader(inner, max_delay_s=chaos_max_delay_s, seed=seed) if chaos else inner
        config = config.replace(offloader=AuditedOffloader(chained), host_budget_bytes=None)
    try:
        cache = tba.configure_tensor_cache(twin, config)
    except BaseException:
        if inner is not None:
            inner.close()
        raise

    def settle() -> None:
        cache.wait_for_stores(store_timeout_s)

    runners = _compiled(model, twin, compile, compile_options)
    outcome = _Outcome()
    with rng_restored():
        try:
            for step, batch in enumerate(batches):
                outcome.steps = step + 1
                reference = _Run(runners[0], optimizers[0], clone_tensors(batch))
                with_tba = _Run(runners[1], optimizers[1], batch)
                reference.backward(loss_of, seed + step, None)
                if not outcome.run_twin(lambda: with_tba.backward(loss_of, seed + step, settle), step, sanitize):
                    break
                if not outcome.compared(*reference.compare_grads(with_tba, step)):
                    break
                reference.step(seed + step)
                if not outcome.run_twin(lambda: with_tba.step(seed + step), step, sanitize):
                    break
                if not outcome.compared(*reference.compare_state(with_tba, step), add=True):
                    break
                logger.info("tba parity check: step %d of %d bit-identical", step + 1, len(batches))
        finally:
            outcome.run_twin(cache.close, outcome.steps - 1, False)
    total = cache.stats(cumulative=True)
    name = inner.name if inner is not None else "none"
    return outcome.report(total.offloaded_bytes, total.reloaded_bytes, name, devices, config.offload_devices)


class _Outcome:
    """What the check found so far: steps run, tensors compared, the first mismatch or error."""

    def __init__(self) -> None:
        self.steps = 0
        self.num_compared = 0
        self.mismatch: Mismatch | None = None
        self.error: str | None = None

    def run_twin(self, work: Callable[[], None], step: int, sanitize: bool) -> bool:
        """Run ``work`` on the model with tba; an exception the plain model did not raise is
        the check's finding (the first one kept, with its traceback logged)."""
        try:
            with stream_sanitizer() if sanitize else contextlib.nullcontext():
                work()
        except Exception as exc:
            logger.error("tba parity check: the model with tba raised at step %d", step, exc_info=exc)
            if self.error is None and self.mismatch is None:
                self.error = f"step {step}: the model with tba raised {type(exc).__name__}: {str(exc).rstrip('.')}"
            return False
        return True

    def compared(self, mismatch: Mismatch | None, num_compared: int, *, add: bool = False) -> bool:
        self.num_compared = self.num_compared + num_compared if add else num_compared
        self.mismatch = mismatch
        return mismatch is None

    def report(
        self, offloaded: int, reloaded: int, offloader: str, devices: set[str], offload_devices: tuple[str, ...]
    ) -> ParityReport:
        ok = False
        if self.mismatch is not None or self.error is not None:
            found = self.mismatch if self.mismatch is not None else self.error
            reason = (f"{found}; without tba it did not: tba changed the result (with chaos or on "
                      "CUDA, run again to see whether it depends on timing)")
        elif offloader == "none":
            ok, reason = True, "bit-identical; offloader 'none' moves nothing, as meant"
        elif offloaded == 0:
            if not devices & set(offload_devices):
                why = (f"the model is on {sorted(devices)} but offload_devices={offload_devices}: "
                       f"pass offload_devices={tuple(sorted(devices))} or force=True")
            else:
                why = ("every saved tensor stayed in memory (under min_offload_bytes, in the kept "
                       "last blocks, or kept by the adaptive policy): pass force=True to send every "
                       "tensor out")
            reason = f"bit-identical, but nothing was offloaded, so that proves nothing: {why}"
        elif reloaded == 0:
            reason = ("bit-identical, but nothing was read back (backward found every tensor still "
                      "in memory), so that proves nothing: pass force=True")
        else:
            ok, reason = True, "losses, gradients, parameters and buffers bit-identical at every step"
        return ParityReport(ok=ok, steps=self.steps, offloaded_bytes=offloaded, reloaded_bytes=reloaded,
                            first_mismatch=self.mismatch, error=self.error, offloader=offloader,
                            num_compared=self.num_compared, reason=reason)


@dataclasses.dataclass
class _Run:
    """One of the two models through one step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    loss: torch.Tensor | None = None

    def backward(self, loss_of: LossFn, seed: int, after_forward: Callable[[], None] | None) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        seed_all(seed)
        loss = checked_loss(loss_of(self.model, self.batch))
        if after_forward is not None:
            after_forward()
        loss.backward()
        self.loss = loss.detach()

    def step(self, seed: int) -> None:
        seed_all(seed)
        self.optimizer.step()

    def compare_grads(self, twin: _Run, step: int) -> tuple[Mismatch | None, int]:
        pairs = [("loss", self.loss, twin.loss)] + [
            (f"grad of {name}", p.grad, q.grad)
            for (name, p), q in zip(self.model.named_parameters(), twin.model.parameters())
        ]
        return _first(step, pairs), len(pairs)

    def compare_state(self, twin: _Run, step: int) -> tuple[Mismatch | None, int]:
        pairs = [
            (f"parameter {name}", p.detach(), q.detach())
            for (name, p), q in zip(self.model.named_parameters(), twin.model.parameters())
        ] + [
            (f"buffer {name}", b, c)
            for (name, b), c in zip(self.model.named_buffers(), twin.model.buffers())
        ]
        return _first(step, pairs), len(pairs)


def _first(
    step: int, pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]]
) -> Mismatch | None:
    for name, expected, got in pairs:
        mismatch = compare(step, name, expected, got)
        if mismatch is not None:
            return mismatch
    return None


def _resolve_options(
    options: dict[str, Any], force: bool, devices: set[str], chaos_max_delay_s: float, store_timeout_s: float
) -> dict[str, Any]:
    """The twin's cache options: ``options`` with what ``force`` sets. Raises ValueError
    listing every problem (unknown names, options that contradict ``force``, bad numbers)."""
    fields = {f.name for f in dataclasses.fields(tba.TensorCacheConfig)}
    problems = [
        f"{name}: unknown option; accepted: check_parity's own keywords and the options of "
        f"tba.configure_tensor_cache ({', '.join(sorted(fields))})"
        for name in sorted(set(options) - fields)
    ]
    resolved = {k: v for k, v in options.items() if k in fields}
    if force:
        for name, value in _FORCED.items():
            if name in resolved and resolved[name] != value:
                problems.append(f"{name}={resolved[name]!r} with force=True, which sets {name}={value!r}: "
                                "drop one of them")
            resolved[name] = value
        resolved.setdefault("offload_devices", tuple(sorted(devices)) or ("cpu",))
    for name, value in (("chaos_max_delay_s", chaos_max_delay_s), ("store_timeout_s", store_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            problems.append(f"{name}={value!r}: expected a number of seconds >= 0")
    if problems:
        raise ValueError("invalid tba.testing.check_parity options:\n" + "\n".join(f"  - {p}" for p in problems))
    return resolved


def _uncompiled(model: nn.Module, compile: str | None) -> tuple[nn.Module, str | None]:
    """The module to copy and configure, and how to compile it: a module compiled with
    ``backend="tba"`` is checked as ``compile="tba"``."""
    from tba import _torch_compat as compat

    if compile not in (None, "tba"):
        raise ValueError(f"tba.testing.check_parity: compile={compile!r}: expected \"tba\" or None")
    original = getattr(model, "_orig_mod", None)
    if not isinstance(original, nn.Module):
        return model, compile
    callback = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    if not compat.is_tba_backend(callback):
        raise ValueError(
            "tba.testing.check_parity: the model was compiled with another backend than "
            "\"tba\"; pass the module itself (with compile=\"tba\" to check tba's backend)"
        )
    return original, "tba"


def _compiled(model: nn.Module, twin: nn.Module, compile: str | None,
              options: dict[str, Any] | None) -> tuple[nn.Module, nn.Module]:
    """What each step calls: the models themselves, or compiled (the reference by the inner
    compiler alone, the twin by tba's backend)."""
    if compile is None:
        return model, twin
    import tba.compile  # noqa: F401  (registers the backend without the installed entry point)

    options = dict(options or {})
    inner = options.get("inner", "inductor")
    # torch.compile of a module returns the module compiled (its stub says a callable).
    return (torch.compile(model, backend=inner),  # type: ignore[return-value]
            torch.compile(twin, backend=tba.compile.backend, options=options))


def _device_types(model: nn.Module) -> set[str]:
    return {t.device.type for t in (*model.parameters(), *model.buffers())}


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
