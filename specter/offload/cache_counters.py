"""What an expert cache counts in one request: lookups, loads by reason, evictions, same-window reloads."""
from __future__ import annotations

from dataclasses import asdict, dataclass

PREFETCH = "prefetch"
CAUSES = (PREFETCH, "ahead", "verify")  # what evicted an expert that the same window loads again


@dataclass
class CacheCounters:
    """What the cache did in one request: lookups, loads by reason, evictions, and same-window reloads by the
    cause of the eviction (`CAUSES`)."""

    hits: int = 0
    hits_prefetched: int = 0  # hits on experts the planner loaded
    misses: int = 0
    misses_planned: int = 0  # misses loaded on the draft's plan before the router was read
    wasted_loads: int = 0  # loaded on the plan, not routed
    loads_ahead: int = 0
    prefetch_loads: int = 0
    evictions: int = 0
    reloads_after_prefetch: int = 0
    reloads_after_ahead: int = 0
    reloads_after_verify: int = 0

    def count_reload(self, cause: str) -> None:
        name = f"reloads_after_{cause}"
        setattr(self, name, getattr(self, name) + 1)

    @property
    def loads(self) -> int:
        """Experts copied in on demand or by a prefetch."""
        return self.misses + self.prefetch_loads

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
