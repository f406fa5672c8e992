"""Which blocks are offloaded: the boundary rule and budget mode (``boundary.py``), the forward
profile they decide from, the closed loop that checks a boundary against measured step time
(``closed_loop.py``; its steady window, looking up under a knee, disturbed steps, memory for
keep steps and events in ``steady_window.py``, ``look_up.py``, ``disturbed.py``,
``keep_memory.py``, ``loop_event.py``), the bracket search it measures boundaries by
(``bracket_search.py``) and their paired ratios, and the diagnosis of a cache that offloaded
nothing.

May import from ``tba.cache``: ``tba.cache.engine``, ``tba.cache.observe``.
May import from outside it: ``tba.config``, ``tba.settings``, ``tba._torch_compat``.
Not ``steps``, ``capture`` or ``tensor_cache``, not even for types.
"""
