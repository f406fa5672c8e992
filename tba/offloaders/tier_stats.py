"""`TierStats`: what one tier of a tiered offloader stored and held, and how to explain it.

An offloader with tiers (``offloader="host+ssd"``) offers ``take_tier_stats()``; the cache
calls it when a step finishes and keeps the result in ``CacheStats.tiers``. Any offloader may
offer it: the cache does not ask which offloader it has.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TierStats", "merge_tiers", "take_tier_stats"]


@dataclasses.dataclass
class TierStats:
    """Counters of one tier over a step (``CacheStats.tiers``) or over the offloader's life.

    Attributes:
        num_stored: tensors stored in this tier.
        stored_bytes: their bytes.
        held_bytes: bytes this tier held at the end (stored and not yet released).
        peak_held_bytes: most bytes this tier held at once.
        budget_bytes: most bytes this tier may hold at once (None: no bound of its own).
        num_over_budget: tensors this tier turned away because holding them would have taken
            it past ``budget_bytes``; they went to the next tier.
        num_no_room: tensors this tier turned away within its budget because its pool had no
            contiguous room for them (fragmentation, 512-byte rounding); they went to the next
            tier.
    """

    num_stored: int = 0
    stored_bytes: int = 0
    held_bytes: int = 0
    peak_held_bytes: int = 0
    budget_bytes: int | None = None
    num_over_budget: int = 0
    num_no_room: int = 0

    def merged(self, later: TierStats) -> TierStats:
        """Totals of this interval followed by ``later``: counts add, peaks take the maximum,
        ``held_bytes`` and ``budget_bytes`` are ``later``'s."""
        return TierStats(
            num_stored=self.num_stored + later.num_stored,
            stored_bytes=self.stored_bytes + later.stored_bytes,
            held_bytes=later.held_bytes,
            peak_held_bytes=max(self.peak_held_bytes, later.peak_held_bytes),
            budget_bytes=later.budget_bytes,
            num_over_budget=self.num_over_budget + later.num_over_budget,
            num_no_room=self.num_no_room + later.num_no_room,
        )


def merge_tiers(earlier: dict[str, TierStats], later: dict[str, TierStats]) -> dict[str, TierStats]:
    """Tier-by-tier :meth:`TierStats.merged`, in the tiers' order."""
    out = {name: dataclasses.replace(stats) for name, stats in earlier.items()}
    for name, stats in later.items():
        out[name] = out[name].merged(stats) if name in out else dataclasses.replace(stats)
    return out


def take_tier_stats(offloader: object) -> dict[str, TierStats]:
    """The offloader's tier counters since the last call (empty for an offloader without tiers)."""
    take = getattr(offloader, "take_tier_stats", None)
    stats: dict[str, TierStats] = take() if callable(take) else {}
    return stats
