"""Prefetch precision and recall: the draft-planned experts against the target's actual routing per window."""
from __future__ import annotations


class PrefetchQuality:
    """Accumulates |planned ∩ routed|, |planned| and |routed| over (window, layer) pairs."""

    def __init__(self) -> None:
        self.true_positive = self.planned = self.routed = 0

    def add(self, planned: dict[int, set], routed: dict[int, set]) -> None:
        for layer in set(planned) | set(routed):
            p, r = set(planned.get(layer, ())), set(routed.get(layer, ()))
            self.true_positive += len(p & r)
            self.planned += len(p)
            self.routed += len(r)

    def stats(self) -> dict:
        nan = float("nan")
        return {
            "prefetch_precision": self.true_positive / self.planned if self.planned else nan,
            "prefetch_recall": self.true_positive / self.routed if self.routed else nan,
        }
