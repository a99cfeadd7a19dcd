"""Victim policies of the expert cache (LRU, lookahead, popularity) and the target routing counts they read."""
from __future__ import annotations

from dataclasses import dataclass, field

from specter.config import EVICTION_POLICIES


@dataclass
class RoutingCounts:
    """Tokens the target routed to each expert of each layer in this request: the residency manager adds
    them, the popularity policy reads them."""

    by_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [E] tokens routed to each expert

    def add(self, layer: int, num_experts: int, routing: list[list[int]]) -> None:
        """Count one layer's routing (host lists [T][k])."""
        counts = self.by_layer.setdefault(layer, [0] * num_experts)
        for token in routing:
            for expert in token:
                counts[expert] += 1

    def get(self, layer: int) -> list[int] | None:
        return self.by_layer.get(layer)

    def per_layer(self, num_layers: int) -> list[list[int]]:
        """[L] lists of [E] counts ([] for a layer the target has not routed yet)."""
        return [self.by_layer.get(layer, []) for layer in range(num_layers)]

    def clear(self) -> None:
        self.by_layer.clear()


class LRUPolicy:
    """The paper's policy: evict the least recently used unprotected slot (empty slots first).

    `slots` is the layer's LayerSlots; `keep` holds experts that must stay, `predicted` experts the
    current draft window routes to (only the lookahead policy reads it)."""

    name = "lru"

    def victim(self, layer: int, slots, keep: frozenset = frozenset(),
               predicted: frozenset = frozenset()) -> int | None:
        candidates = [s for s in slots.unprotected_lru() if slots.expert_of[s] not in keep]
        empty = [s for s in candidates if slots.expert_of[s] is None]
        return (empty or candidates or [None])[0]

    def stream_victim(self, layer: int, slots) -> int | None:
        """The victim of a copy streamed into a verify layer's released slots (`victim` unless overridden)."""
        return self.victim(layer, slots)


class LookaheadPolicy(LRUPolicy):
    """LRU, but never evicts an expert the current window's draft routing predicts while another slot will do."""

    name = "lookahead"

    def victim(self, layer: int, slots, keep: frozenset = frozenset(),
               predicted: frozenset = frozenset()) -> int | None:
        preferred = super().victim(layer, slots, keep | predicted)
        return preferred if preferred is not None else super().victim(layer, slots, keep)


class PopularityPolicy(LRUPolicy):
    """Evict the unprotected slot whose expert the target has routed the fewest tokens to in this request
    (least recently used among ties): popular experts stay resident across windows, and a prefetch
    replaces the resident expert least likely to be needed."""

    name = "popularity"

    def __init__(self, counts: RoutingCounts) -> None:
        self.counts = counts

    def victim(self, layer: int, slots, keep: frozenset = frozenset(),
               predicted: frozenset = frozenset()) -> int | None:
        candidates = [s for s in slots.unprotected_lru() if slots.expert_of[s] not in keep]
        counts = self.counts.get(layer)
        if counts is None or not candidates or any(slots.expert_of[s] is None for s in candidates):
            return super().victim(layer, slots, keep)  # empty slots first, as LRU
        return min(candidates, key=lambda s: counts[slots.expert_of[s]])  # the first (LRU) among ties

    def stream_victim(self, layer: int, slots) -> int | None:
        """Least routed among the slots released earliest (one launch's slots share a last-use event): a
        copy into a slot the latest wave still reads would hold up the copy stream until that wave ends."""
        candidates = slots.unprotected_lru()
        if not candidates or any(slots.expert_of[s] is None for s in candidates):
            return super().victim(layer, slots)  # nothing to choose, or empty slots first (LRU)
        earliest = min(slots.released[s] for s in candidates)
        released_later = frozenset(slots.expert_of[s] for s in candidates if slots.released[s] != earliest)
        return self.victim(layer, slots, keep=released_later)


POLICIES = EVICTION_POLICIES


def make_policy(name: str, counts: RoutingCounts) -> LRUPolicy:
    """The victim policy called `name`; the popularity policy reads `counts`."""
    if name == "lru":
        return LRUPolicy()
    if name == "lookahead":
        return LookaheadPolicy()
    if name == "popularity":
        return PopularityPolicy(counts)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
