"""The tensor cache: what autograd saves, offloaded during forward and reloaded for backward.

One folder per concern, in layers; a layer imports only the layers below it, never one above,
not even for types (under ``if TYPE_CHECKING``): where a lower layer holds an object of an
upper one it names what it needs with a ``typing.Protocol``. Each folder's ``__init__`` says
what it owns and what it may import; tests/cache/test_layout.py reads those rules and walks the
imports of every module under tba/.

From the top:

- ``tensor_cache.py``: ``TensorCache``, the public face, which builds the parts below and wires
  them together (the one module that knows them all; nothing in a folder imports it).
- ``capture/``: the hooks that capture saved tensors (module hooks, tba's place in PyTorch's
  stack of saved-tensor hooks, the pack and unpack hooks, packed subclasses, run order).
- ``steps/``: what a step is made of and where it ends (units, scopes and records of forward
  passes, each thread's forward state, the step tracker, stage hints, finished steps).
- ``policy/``: which blocks are offloaded (the boundary rule, budget mode, the forward
  profile, the closed loop and its paired ratios, why nothing was offloaded).
- ``engine/``: the one owner of entry life (entries, their states, transfers, counters, the
  worker threads, the stream/event layer, the Ctrl-C guard of its lock).
- ``observe/``: what the cache reports (step stats, Chrome trace, profiler ranges, step clock).

The modules at this level (``tensor_cache.py``):
May import from ``tba.cache``: ``tba.cache.capture``, ``tba.cache.steps``, ``tba.cache.policy``,
``tba.cache.engine``, ``tba.cache.observe``.
May import from outside it: ``tba.config``, ``tba.errors``, ``tba.offloaders``, ``tba._env``.
Never the ``tba`` package itself, ``tba.testing`` or the integrations: they import the cache.

The data path of a saved tensor, in the order it runs:

1. pack: ``capture/hooks.py`` enters ``capture/saving.py``'s hook pair at each forward of the
   model (``capture/hook_stack.py`` chains it with the script's own pair); autograd calls
   ``SavedTensors.pack``, which picks the tensor's scope (``steps/scopes.py``) and calls
2. the engine: ``engine/core.py`` ``Engine.save`` makes (or finds) the tensor's entry and its
   handle (``engine/entries.py``, identity in ``engine/table.py``), records the producer event
   (``engine/streams.py``) and queues the store; ``engine/workers.py`` runs it on a worker
   thread,
3. the offloader: ``Offloader.store`` (tba/offloaders/) writes the bytes and returns a token;
   at backward ``steps/tracker.py`` prefetches the scopes backward reaches next
   (``Engine.prefetch``), and a worker calls ``Offloader.load`` into a reload buffer,
4. unpack: autograd calls ``SavedTensors.unpack`` with the handle; ``Engine.fetch`` waits for
   the load (``engine/waits.py``) and the tensor comes back as a view of the reloaded storage,
   ordered on the compute stream (``engine/streams.py``). When autograd frees the handle, the
   engine drops the entry and gives the offloader its space back (``Offloader.release``).
"""
