"""The capture of saved tensors: the module hooks that turn forwards and units into the
tracker's events, tba's place in PyTorch's stack of saved-tensor hooks, the pack and unpack
hooks (``saving.py``), packed wrapper subclasses, the blocks' run order, the module hook
that belongs to one cache, and the cache's side of graphs compiled with ``backend="tba"``
(``compiled.py``: what their store ops call instead of the hooks).

May import from ``tba.cache``: ``tba.cache.steps``, ``tba.cache.policy``, ``tba.cache.engine``,
``tba.cache.observe``.
May import from outside it: ``tba.config``, ``tba.errors``, ``tba._torch_compat``.
Not ``tensor_cache``, not even for types: the cache the hooks keep alive is an ``object`` to
them.
"""
