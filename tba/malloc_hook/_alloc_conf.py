"""PyTorch allocator settings that take CUDA memory past the hook.

The hook sees ``cudaMalloc`` only. With ``expandable_segments:True`` PyTorch maps memory with
``cuMemCreate``/``cuMemMap``, and with ``backend:cudaMallocAsync`` it allocates from CUDA memory
pools: in both cases no segment is registered with cuFile.
"""

from __future__ import annotations

from tba import _env

__all__ = ["allocator_problem", "parse_alloc_conf"]


def parse_alloc_conf(value: str) -> dict[str, str]:
    """Parses PyTorch's ``key:value,key:value`` allocator settings into a dict.

    Commas inside brackets (``roundup_power2_divisions:[256:1,512:2]``) do not split.
    """
    settings: dict[str, str] = {}
    items: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(value):
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
    items.append(value[start:])
    for item in items:
        key, _, setting = item.partition(":")
        if key.strip():
            settings[key.strip()] = setting.strip()
    return settings


def allocator_problem() -> str | None:
    """Why PyTorch's allocator settings hide its CUDA segments from the hook, or None."""
    conf = _env.pytorch_alloc_conf()
    if conf is None:
        return None
    name, value = conf
    settings = parse_alloc_conf(value)
    reasons = []
    if settings.get("expandable_segments", "").lower() == "true":
        reasons.append("expandable_segments:True maps memory with cuMemMap, not cudaMalloc")
    if settings.get("backend", "") == "cudaMallocAsync":
        reasons.append("backend:cudaMallocAsync allocates from CUDA memory pools, not cudaMalloc")
    if not reasons:
        return None
    return (
        f"{name}={value!r} keeps PyTorch's CUDA memory away from the malloc hook "
        f"({'; '.join(reasons)}), so it is not registered with cuFile: remove "
        f"{' and '.join(reason.split(' ', 1)[0] for reason in reasons)} from {name}"
    )
