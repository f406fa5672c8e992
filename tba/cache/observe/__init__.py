"""What the cache reports: step stats (``CacheStats``), the Chrome trace, ``torch.profiler``
ranges, and the step clock that times steps and blocks.

Lowest layer of ``tba.cache``: everything else may import it.

May import from ``tba.cache``: nothing.
May import from outside it: ``tba.settings``, ``tba._torch_compat``, ``tba.offloaders`` (their
tier stats).
The entries and scopes a range is named after are ``Protocol`` types here
(``profiler_ranges.Transferred``, ``profiler_ranges.UnitScope``).
"""
