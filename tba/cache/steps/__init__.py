"""What a step is made of and where it ends: units (which modules open scopes), the scopes and
records of forward passes, each thread's forward state, the step tracker (step boundaries and
the prefetch walk of backward), pipeline stage hints, and the finished steps' stats and
adaptive cycle (``steps.py``).

May import from ``tba.cache``: ``tba.cache.policy``, ``tba.cache.engine``, ``tba.cache.observe``.
May import from outside it: ``tba.config``, ``tba.offloaders`` (the protocol), ``tba.settings``,
``tba._torch_compat``.
Not ``capture`` or ``tensor_cache``, not even for types.
"""
