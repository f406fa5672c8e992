"""Make plain PyTorch on the CPU repeat itself, so that a bit-exact comparison can only fail
because of tba.

Note [First VML call race]: PyTorch's CPU build computes sqrt, exp, log, erf, tanh and a dozen
other float functions with MKL's vector math library (``vm[sd]<Op>``, accuracy mode HA), in
chunks of 2048 elements spread over the OpenMP threads. MKL picks its implementation of each
function lazily, on the first call, and when that first call comes from two threads at once
(any tensor of more than 2048 elements, with two or more threads), the chunk of one thread is
sometimes computed with a far less accurate path: relative errors up to about 1e-4 instead of
under an ulp. Later calls are accurate. Measured on the 2-core development VM (torch 2.13.0+cpu,
MKL 2024.2): ``x.sqrt()`` of 4096 floats, run twice in a fresh process, gave two different
results in about 1 process in 15; never after a one-chunk call (16 elements, one thread) had
initialised it, and never with ``OMP_NUM_THREADS=1``.

In tba's twin tests this showed up as a rare "grad of bert.embeddings.word_embeddings.weight
differs" at step 1: the first Adam step of the first model computed ``exp_avg_sq.sqrt()`` of its
first parameter (4096 elements) with the inaccurate path for the first 2048 elements, so that
model's parameters, and every gradient of the next step, differed from its twin's. It made the
reference (the model without tba) differ from a second plain copy of itself exactly as it
differed from the tba model, so tba was not involved.

:func:`initialise_vector_math` makes every such first call from one thread, on a tensor of one
chunk, before anything compared is computed. :func:`tba.testing.check_parity` calls it, and so
does tba's test suite when it starts (``tests/__init__.py``).
"""

from __future__ import annotations

import torch

__all__ = ["initialise_vector_math", "VML_FUNCTIONS"]

# The functions PyTorch's CPU build hands to MKL's vector math (ATen/cpu/vml.h, torch 2.13).
VML_FUNCTIONS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)


def initialise_vector_math() -> None:
    """Call each MKL vector-math function once for float32 and float64, on one thread (Note
    [First VML call race]), so that plain PyTorch on the CPU gives the same result twice.

    Cheap (32 calls on 16 elements) and idempotent; call it before computing anything you
    will compare bit for bit.

    Example:
        >>> from tba.testing import initialise_vector_math
        >>> initialise_vector_math()
    """
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(0.1, 0.9, 16, dtype=dtype)  # inside every function's domain
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
