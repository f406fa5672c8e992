"""`tba.testing`: what tests and extenders of tba use (imported explicitly: ``import
tba.testing``; ``import tba`` does not load it).

- :func:`probe`: a read-only view of a cache's insides.
"""

from tba.testing.probe import CacheProbe, probe

__all__ = ["probe", "CacheProbe"]
