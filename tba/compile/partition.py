"""`Partitioner`: AOTAutograd's min-cut partition, then tba's plan, rewrite and checks.

What the backward needs is decided by the partitioner exactly as without tba (the same saved
values, so the same numbers); tba then changes only how the saved values get there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import fx, nn
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from tba.cache.capture.compiled import CompiledForwards
from tba.cache.steps.scopes import matches
from tba.cache.tensor_cache import TensorCache
from tba.compile import lowering, runtime, verify
from tba.compile.plan import Rules, StoreGroup, plan_stores
from tba.compile.rewrite import rewrite_backward, rewrite_forward
from tba.errors import TBAError

__all__ = ["Partitioner", "GraphReport", "rules_for"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GraphReport:
    """What one rewrite did (``Partitioner.reports``, for tests and logs).

    Attributes:
        graph_id: the id the graph's stores carry.
        num_saved: tensors the partitioner saved for backward.
        num_groups: storages stored (one store op each).
        num_members: saved tensors stored (views of one storage count once each).
        units: the unit of each group, in store order.
        num_off_device: saved activations left alone because of ``offload_devices`` (of any
            size).
        num_small: saved activations on ``offload_devices`` left alone because their storage
            is smaller than ``min_offload_bytes`` (counted when nothing is stored).
    """

    graph_id: int
    num_saved: int
    num_groups: int
    num_members: int
    units: tuple[str | None, ...]
    num_off_device: int
    num_small: int = 0


def _skipped(model: nn.Module, specs: tuple[Any, ...], path: str) -> bool:
    if not specs or not path:
        return False
    parts = path.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            return False
        if matches(module, prefix, specs):
            return True
    return False


def _unit_name(seam: CompiledForwards, path: str) -> str | None:
    unit = seam.unit_of(path)
    return unit.name if unit is not None else None


def rules_for(cache: TensorCache, model: nn.Module,
              input_paths: tuple[str | None, ...] = ()) -> Rules:
    """What ``cache``'s configuration says about saved values of ``model``'s graphs (paths
    taken as the model's own: Note [Units at run time])."""
    return Rules(
        devices=frozenset(cache.config.offload_devices),
        unit_of=functools.partial(_unit_name, cache._compiled_forwards()),
        skipped=functools.lru_cache(maxsize=None)(
            functools.partial(_skipped, model, tuple(cache.config.skip_modules))),
        input_paths=input_paths,
        min_bytes=max(1, cache.config.min_offload_bytes),
    )


class Partitioner(CustomPartitionerFn):
    """A partition function for AOTAutograd (``aot_autograd(partition_fn=...)``) and for
    Inductor (``torch._inductor.config.custom_partitioner_fn``) that offloads the saved
    activations of ``model`` with ``cache``.

    Args:
        model: the configured model (held weakly by what the graph keeps).
        cache: its tensor cache at compile time (the graph uses whichever cache the model has
            when it runs).
        partition: the partition function to wrap (min-cut by default).
        input_paths: ``Rules.input_paths`` of the compiled frame.
    """

    def __init__(self, model: nn.Module, cache: TensorCache,
                 partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]] | None = None,
                 input_paths: tuple[str | None, ...] = (), late_stores: bool = False) -> None:
        # Weakly: Inductor may keep its config (this object) with the compiled code, and a
        # compiled graph must not keep the model or its cache alive.
        self._model = weakref.ref(model)
        self._cache = weakref.ref(cache)
        self._partition = partition or min_cut_rematerialization_partition
        self._input_paths = input_paths
        self._late_stores = late_stores  # Note [Forward in plain Inductor's order]
        self.reports: list[GraphReport] = []

    def __deepcopy__(self, memo: dict[int, object]) -> Partitioner:
        return self  # Inductor copies its config (this is part of it) to key its caches

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any,
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = self._partition(gm, joint_inputs, **kwargs)
        self.rewrite(fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    def rewrite(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
        """Plan, rewrite and check one partitioned pair in place."""
        cache, model = self._cache(), self._model()
        if cache is None or model is None or cache.closed:
            raise TBAError("tba: the tensor cache was closed while its model was being compiled")
        rules = rules_for(cache, model, self._input_paths)
        groups = plan_stores(fw, num_fwd_outputs, rules)
        output = fw.graph.find_nodes(op="output")[0]
        num_saved = len(output.args[0]) - num_fwd_outputs
        off_device = plan_stores(fw, num_fwd_outputs, dataclasses.replace(
            rules, devices=frozenset(("cpu", "cuda", "xpu", "mps", "hpu")) - rules.devices,
            min_bytes=0))
        graph_id = -1
        if groups:
            graph_id = runtime.register_graph(model, cache)
            reusable = lowering.reusable_saved(fw, bw, num_fwd_outputs)
            swaps = rewrite_forward(fw, groups, num_fwd_outputs, graph_id, late=self._late_stores)
            rewrite_backward(bw, swaps, cache.config.prefetch_modules, reusable)
            verify.check_forward(fw, num_fwd_outputs)
            verify.check_backward(fw, bw, num_fwd_outputs)
        small = 0 if groups else _num_members(
            plan_stores(fw, num_fwd_outputs, dataclasses.replace(rules, min_bytes=0)))
        report = GraphReport(graph_id, num_saved, len(groups), _num_members(groups),
                             tuple(g.unit for g in groups), _num_members(off_device), small)
        self.reports.append(report)
        logger.info("tba compile: %s", report)

    def uuid(self) -> Any:
        """None: the compiled code is not cached (Note [Rewritten graphs are not cached] in
        compiler.py)."""
        return None


def _num_members(groups: list[StoreGroup]) -> int:
    return sum(len(group.members) for group in groups)
