"""How much memory a keep step of the closed loop could use.

Note [Memory for keep steps]: a keep step holds every activation of the step in memory, which
offloading was meant to avoid: the cache starts the loop only when the memory free at the
decision covers what the rule's boundary would have offloaded (``free_memory_bytes``, with the
margin ``CLOSED_LOOP_KEEP_MARGIN``); otherwise the rule's boundary stands and the decision says
why (tba/cache/steps/steps.py). Tested in tests/cache/test_closed_loop.py.
"""

from __future__ import annotations

from tba.settings import CLOSED_LOOP_KEEP_MARGIN as KEEP_MARGIN

__all__ = ["KEEP_MARGIN", "free_memory_bytes"]


def free_memory_bytes(cuda: bool) -> int:
    """Memory a keep step could still use: on CUDA what the driver has free plus what torch's
    caching allocator holds unused; on CPU the memory the OS reports available."""
    if cuda:
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    import psutil  # not at module level: ``import tba`` loads no native library

    return int(psutil.virtual_memory().available)
