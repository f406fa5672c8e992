"""Make plain PyTorch on the CPU repeat itself in the tests (Note [First VML call race] in
tba/testing/_determinism.py): ``tests/__init__.py`` calls :func:`initialise_vector_math`, so
it runs in the pytest process and in every subprocess script that imports ``tests``."""

from __future__ import annotations

from tba.testing._determinism import VML_FUNCTIONS, initialise_vector_math

__all__ = ["initialise_vector_math", "VML_FUNCTIONS"]
