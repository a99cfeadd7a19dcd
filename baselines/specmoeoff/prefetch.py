"""SpecMoEOff's prefetch: after fixed early draft steps, the draft's most frequent experts per layer so far."""
from __future__ import annotations

from collections.abc import Iterable

from specter.offload.expert_cache import ExpertCache
from specter.prefetch.lookahead import PatternAnalyzer
from specter.prefetch.planner import WindowTrace

FIXED = "fixed"


class FixedPositionPrefetch:
    """Specter's planner interface (begin_window / after_draft_token / end_window, traces) with SpecMoEOff's
    schedule: prefetch points at fixed draft steps, no cost-sized chunks, no cleanup phase.

    After each draft step listed in `positions`, the draft's routing counts of this window rank each
    layer's experts (Specter's lookahead counters and analyzer); the top M (M = slots per layer) that
    are not resident are copied in on the copy stream. Resident planned experts are touched first, so
    the LRU victims lie outside the plan, and a window's prefetches never evict each other (the cache's
    window plan). Windows shorter than a position skip it.
    """

    def __init__(self, analyzer: PatternAnalyzer, cache: ExpertCache, positions: Iterable[int]) -> None:
        self.analyzer, self.cache = analyzer, cache
        self.positions = tuple(sorted(set(positions)))
        self.traces: list[WindowTrace] = []
        self.trace = WindowTrace(0)

    def begin_window(self, k: int) -> None:
        self.trace = WindowTrace(k)

    def after_draft_token(self, drafted: int) -> bool:
        """Prefetch if `drafted` is a configured position; True when it did (the host read the counts)."""
        if drafted not in self.positions:
            return False
        ranking = self.analyzer.ranking()  # layer -> experts, most frequent first (one D2H copy)
        plan = {layer: ranked[: self.cache.slots_per_layer] for layer, ranked in ranking.items()}
        self.trace.boundaries.append(drafted)
        self.trace.phases.append(FIXED)
        self.trace.batch_sizes.append(self._issue(plan))
        return True

    def _issue(self, plan: dict[int, list[int]]) -> int:
        """Copies for the planned experts that are not resident; returns how many were started."""
        self.cache.window_plan = self.trace.planned  # the cache never evicts these for this window's copies
        issued = 0
        for layer, experts in plan.items():
            for expert in experts:
                self.cache.touch(layer, expert)
            for expert in experts:
                resident = self.cache.slot_of(layer, expert) is not None
                if resident or self.cache.prefetch(layer, expert):
                    issued += not resident
                    self.trace.planned.setdefault(layer, set()).add(expert)
        return issued

    def end_window(self) -> WindowTrace:
        """Clear the counters and the window's plan; keep the trace."""
        self.analyzer.elb.clear()
        self.cache.window_plan = {}
        self.traces.append(self.trace)
        return self.trace

    def reset(self) -> None:
        self.traces = []
