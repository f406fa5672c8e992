"""tba inside compiled graphs: the ``"tba"`` backend of ``torch.compile``.

Note [Offload inside the compiled graph]: a graph compiled from a whole model hands its saved
tensors to saved-tensor hooks only when it returns (pytorch#148222), so tba's eager mechanism
cannot offload inside it. The ``"tba"`` backend moves the mechanism into the graph instead:
Dynamo traces tba's module hooks to nothing (``compat.tracing_for_tba``), AOTAutograd's
min-cut partitioner decides what backward needs exactly as without tba, and then
  * plan.py picks the saved activations to store and groups aliases by storage (Note [What
    a compiled graph stores]),
  * rewrite.py puts a ``tba::store`` after each group's last forward use and a
    ``tba::reload`` before each member's first backward use, with ``tba::prefetch`` ahead
    by ``prefetch_modules`` units (Note [Placing stores, prefetches and reloads]),
  * verify.py checks the placement on every compile (Note [Checked placement]),
  * under Inductor, lowering.py keeps what the cache reads after an op out of Inductor's
    buffer reuse (Note [Stored buffers are not reused]) and scheduling.py plans both graphs
    as plain Inductor plans them, then places tba's ops (Notes [Forward in plain Inductor's
    order] and [Backward in plain Inductor's order]), so Inductor's own kernels stay its own,
  * ops.py defines the ops (Note [Effects as ops]) and runtime.py runs them against the
    model's tensor cache (Note [Keys and shape carriers]; the cache's side is
    tba/cache/capture/compiled.py, Note [The cache under compiled graphs]),
so a compiled step goes through the same engine, offloaders, policy, accounting, errors,
stats, summary, trace and invariant checks as an eager one.

This package may import torch's compiler internals (Dynamo, AOTAutograd, Inductor) and
``tba.cache``; nothing in ``tba.cache`` imports it. ``import tba`` does not import it; Dynamo
does, through the ``torch_dynamo_backends`` entry point, when a backend named ``"tba"`` is
first asked for.

Example:
    >>> cache = tba.configure_tensor_cache(model, offloader="ssd")  # doctest: +SKIP
    >>> compiled = torch.compile(model, backend="tba", fullgraph=True)  # doctest: +SKIP
"""

from tba.compile import ops  # noqa: F401  (registers tba::store, tba::prefetch, tba::reload)
from tba.compile.compiler import INNER_COMPILERS, backend
from tba.compile.partition import GraphReport, Partitioner
from tba.compile.runtime import watch

__all__ = ["backend", "INNER_COMPILERS", "Partitioner", "GraphReport", "watch"]
