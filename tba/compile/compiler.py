"""The ``"tba"`` torch.compile backend: Inductor (or ``aot_eager``) with tba's partitioner.

Registered under the ``torch_dynamo_backends`` entry point group (pyproject.toml), so
``torch.compile(model, backend="tba")`` and Hugging Face's
``TrainingArguments(torch_compile=True, torch_compile_backend="tba")`` find it once tba is
installed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from tba import _torch_compat as compat
from tba.cache.tensor_cache import TensorCache
from tba.compile import lowering, scheduling
from tba.compile.partition import Partitioner
from tba.compile.plan import normalize_path
from tba.errors import TBAError
from tba.integrations import registry

__all__ = ["backend", "INNER_COMPILERS"]

logger = logging.getLogger(__name__)

INNER_COMPILERS = ("inductor", "aot_eager")
# Note [Rewritten graphs are not cached]: torch.compile's caches (Inductor's FX graph cache,
# AOTAutograd's cache, local and remote) are kept off for the graphs tba rewrites. A cache hit
# would be wrong: AOTAutograd's cache returns the compiled forward and backward without
# running the partitioner, so no graph is registered for the store ops' graph id (a counter of
# this process, Note [Whose graph is it] in runtime.py) and no plan is made for this model.
# Left on, the caches only computed a key and gave up: the key pickles Inductor's config,
# whose custom_partitioner_fn (the Partitioner) holds the model and cache weakly, and a weak
# reference does not pickle (torch 2.11 warned "Failed to pickle cache key" per compile).
# Graphs of models without a cache keep the caches. Tested by tests/compile/test_backend.py.
# Note [Stored buffers are not reused] (lowering.py): the only other change to Inductor.
_INDUCTOR_PATCHES = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
_AUTOGRAD_CACHE_OFF = {"enable_autograd_cache": False, "enable_remote_autograd_cache": False}
_CUDAGRAPH_OPTIONS = ("triton.cudagraphs", "triton_cudagraphs")


def _parse(mode: str | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """(inner compiler, Inductor config patches) from ``torch.compile``'s mode and options.

    Raises:
        ValueError: every problem at once.
    """
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    problems = []
    if inner not in INNER_COMPILERS:
        problems.append(f"options['inner']={inner!r}: expected one of {INNER_COMPILERS}")
    patches: dict[str, Any] = {}
    if inner == "inductor":
        from torch._inductor import config, list_mode_options

        known = config.get_config_copy()
        if mode is not None and mode != "default":
            if mode not in list_mode_options():
                problems.append(f"mode={mode!r}: expected one of {sorted(list_mode_options())}")
            else:
                patches.update(list_mode_options(mode))
        for name, value in options.items():
            attr = name.replace("-", "_")
            if attr not in known:
                problems.append(f"options[{name!r}]: not an Inductor option (torch._inductor.config)")
            patches[attr] = value
    elif options or (mode not in (None, "default")):
        problems.append(
            f"mode={mode!r} and options {sorted(options)} are Inductor's: with "
            "options['inner']='aot_eager' pass neither"
        )
    if problems:
        raise ValueError("invalid options for torch.compile(backend=\"tba\"):\n"
                         + "\n".join(f"  - {p}" for p in problems))
    return inner, patches


def _configured_models(ids: set[int]) -> list[tuple[nn.Module, TensorCache]]:
    """The models with an open tensor cache that own a parameter or buffer in ``ids``."""
    return [
        (module, cache) for module, cache in registry.registered()
        if isinstance(cache, TensorCache) and not cache.closed
        and any(id(t) in ids for t in itertools.chain(module.parameters(), module.buffers()))
    ]


def _find_cache(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[nn.Module, TensorCache] | None:
    """The configured model whose parameters or buffers the graph takes, with its cache."""
    ids = {id(t) for t in example_inputs if isinstance(t, torch.Tensor)}
    ids.update(id(t) for t in itertools.chain(gm.parameters(), gm.buffers()))
    found = _configured_models(ids)
    if len(found) > 1:
        names = ", ".join(type(module).__name__ for module, _ in found)
        raise TBAError(
            f"tba: one compiled graph uses the parameters of {len(found)} models with tensor "
            f"caches ({names}); compile each configured model on its own"
        )
    return found[0] if found else None


def _input_paths(gm: fx.GraphModule) -> tuple[str | None, ...]:
    """For each input of Dynamo's graph, the path of the parameter or buffer it is, relative
    to the module whose frame was compiled (Note [Units at run time] in plan.py)."""
    paths: list[str | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name  # a method in older torch
        if isinstance(name, str) and ("_parameters[" in name or "_buffers[" in name):
            paths.append(normalize_path(name))
        else:
            paths.append(None)
    return tuple(paths)


def _compile(gm: fx.GraphModule, example_inputs: list[Any], inner: str, patches: dict[str, Any],
             partitioner: Partitioner | None) -> Callable[..., Any]:
    if inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        compiler = aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, keep_inference_input_mutations=True,
            partition_fn=partitioner or min_cut_rematerialization_partition,
        )
        compiled: Callable[..., Any] = compiler(gm, example_inputs)
        return compiled
    from torch._inductor.compile_fx import compile_fx

    patches = dict(patches)
    if partitioner is not None:
        if any(patches.get(name) for name in _CUDAGRAPH_OPTIONS):
            raise ValueError(
                "tba: torch.compile(backend=\"tba\") does not support CUDA graphs (mode "
                "\"reduce-overhead\" or \"max-autotune\", option triton.cudagraphs): a replayed "
                "graph would skip tba's stores and reloads; use mode "
                "\"max-autotune-no-cudagraphs\" or the default mode"
            )
        patches.update(_INDUCTOR_PATCHES)
        lowering.install()
        scheduling.install()
        patches["custom_partitioner_fn"] = partitioner
    # Note [Rewritten graphs are not cached]
    caches = (torch._functorch.config.patch(_AUTOGRAD_CACHE_OFF) if partitioner is not None
              else contextlib.nullcontext())
    with caches:
        compiled_fx: Callable[..., Any] = compile_fx(  # type: ignore[assignment]  # a callable
            gm, example_inputs, config_patches=patches)
    return compiled_fx


_warned_no_cache = False


def _placed_by_scheduler(inner: str, patches: dict[str, Any]) -> bool:
    """Whether Inductor's peak-memory pass will run, and with it the placement of tba's stores
    (Note [Forward in plain Inductor's order] in scheduling.py): only then do the stores go to
    the graph's end for the lowering."""
    if inner != "inductor":
        return False
    from torch._inductor import config

    return bool(patches.get("reorder_for_peak_memory", config.reorder_for_peak_memory))


def backend(gm: fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
            options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``torch.compile(model, backend="tba")``: Inductor with tba's offload inside the
    compiled forward and backward graphs, for a model configured with
    :func:`tba.configure_tensor_cache` (docs/integrations.md, torch.compile).

    ``options={"inner": "aot_eager"}`` uses AOTAutograd without Inductor (for debugging);
    other options and ``mode`` are Inductor's, as for ``backend="inductor"`` (CUDA-graph modes
    excepted). A graph of a model without a cache compiles as with the inner compiler alone.

    Example:
        >>> cache = tba.configure_tensor_cache(model, offloader="host")  # doctest: +SKIP
        >>> compiled = torch.compile(model, backend="tba", fullgraph=True)  # doctest: +SKIP
        >>> compiled(batch).loss.backward(); print(cache.stats())  # doctest: +SKIP
    """
    inner, patches = _parse(mode, options)
    found = _find_cache(gm, example_inputs)
    if found is None:
        _note_no_cache()
        compiled = _compile(gm, example_inputs, inner, patches, None)
        return _refuse_later_cache(compiled, gm, example_inputs)
    model, cache = found
    # Markers (Note [Units at run time] in plan.py) only from the configured model's own
    # parameters: a wrapper's tell nothing of where the frame is in the model, and a marker
    # no cache owns then means another instance of the model's class runs the graph.
    owned = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    paths = tuple(path if i < len(example_inputs) and id(example_inputs[i]) in owned else None
                  for i, path in enumerate(_input_paths(gm)))
    partitioner = Partitioner(model, cache, input_paths=paths,
                              late_stores=_placed_by_scheduler(inner, patches))
    compiled = _compile(gm, example_inputs, inner, patches, partitioner)
    reports = partitioner.reports
    if reports and not any(r.num_groups for r in reports) and any(r.num_off_device for r in reports):
        warnings.warn(
            f"tba: the graph compiled with backend=\"tba\" for {type(model).__name__} saves no "
            f"activation on offload_devices={cache.config.offload_devices} (its saved "
            "activations are on other devices), so nothing is offloaded; set offload_devices "
            "to the model's device", UserWarning, stacklevel=2,
        )
    elif reports and not any(r.num_groups for r in reports) and any(r.num_small for r in reports):
        warnings.warn(
            f"tba: the graph compiled with backend=\"tba\" for {type(model).__name__} stores "
            f"nothing: its {sum(r.num_small for r in reports)} saved activations are each "
            f"smaller than min_offload_bytes={cache.config.min_offload_bytes} B, so nothing is "
            "offloaded and the cache sees no step of this graph (stats() and summary() stay "
            "empty); lower min_offload_bytes to offload them", UserWarning, stacklevel=2,
        )
    return compiled


setattr(backend, compat.TBA_BACKEND_ATTR, True)


def _note_no_cache() -> None:
    global _warned_no_cache
    if not _warned_no_cache:
        _warned_no_cache = True
        logger.warning(
            "tba: torch.compile(backend=\"tba\") compiled a graph whose parameters belong to no "
            "model configured with tba.configure_tensor_cache: it is compiled as by the inner "
            "compiler alone and offloads nothing (configure the model before its first "
            "compiled call). Shown once."
        )


def _refuse_later_cache(compiled: Callable[..., Any], gm: fx.GraphModule,
                        example_inputs: list[Any]) -> Callable[..., Any]:
    """``compiled``, raising once a model whose parameters the graph takes gets a cache: the
    graph has no store ops and would silently offload nothing."""
    refs = [weakref.ref(t) for t in itertools.chain(example_inputs, gm.parameters())
            if isinstance(t, nn.Parameter)]

    def check() -> None:
        ids = {id(t) for t in (ref() for ref in refs) if t is not None}
        found = _configured_models(ids)
        if found:
            raise TBAError(
                f"tba: {type(found[0][0]).__name__} was compiled with backend=\"tba\" before "
                "tba.configure_tensor_cache was called on it, so its compiled graphs offload "
                "nothing; call torch.compiler.reset() after configuring (the next call "
                "compiles again, with tba's ops), or configure before the first compiled call"
            )

    if not refs:
        return compiled

    def guarded(*args: Any) -> Any:
        check()
        return compiled(*args)

    disabled: Callable[..., Any] = torch._dynamo.disable(guarded, reason="tba: runs a compiled graph")
    return disabled
