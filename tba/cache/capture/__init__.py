"""The capture of saved tensors: the module hooks that turn forwards and units into the
tracker's events, tba's place in PyTorch's stack of saved-tensor hooks, the pack and unpack
hooks (``saving.py``), packed wrapper subclasses, the blocks' run order, and the module hook
that belongs to one cache.

May import from ``tba.cache``: ``tba.cache.steps``, ``tba.cache.policy``, ``tba.cache.engine``,
``tba.cache.observe``.
May import from outside it: ``tba.config``, ``tba.errors``, ``tba._torch_compat``.
Not ``tensor_cache``, not even for types: the cache the hooks keep alive is an ``object`` to
them.
"""
