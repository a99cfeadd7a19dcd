"""SpecMoEOff's prefetch: after fixed early draft steps, the draft's most frequent experts per layer so far."""
from __future__ import annotations

from collections.abc import Iterable

from specter.offload.expert_cache import ExpertCache
from specter.prefetch.lookahead import PatternAnalyzer
from specter.prefetch.planner import WindowPlan, WindowTrace, issue_prefetches

FIXED = "fixed"


class FixedPositionPrefetch:
    """Specter's planner interface (begin_window / after_draft_token / end_window, traces) with SpecMoEOff's
    schedule: prefetch points at fixed draft steps, no cost-sized chunks, no cleanup phase.

    After each draft step listed in `positions`, the draft's routing counts of this window rank each
    layer's experts (Specter's lookahead counters and analyzer); the top M (M = slots per layer) that
    are not resident are copied in on the copy stream, layer by layer in rank order
    (`issue_prefetches`). Windows shorter than a position skip it. The plan it hands to verification
    holds the prefetched experts only: SpecMoEOff's verification loads on demand.
    """

    def __init__(self, analyzer: PatternAnalyzer, cache: ExpertCache, positions: Iterable[int]) -> None:
        self.analyzer, self.cache = analyzer, cache
        self.positions = tuple(sorted(set(positions)))
        self.traces: list[WindowTrace] = []
        self.trace = WindowTrace(0)

    def begin_request(self, cache: ExpertCache) -> None:
        """A request starts on `cache`: no traces yet."""
        self.cache, self.traces = cache, []

    def begin_window(self, k: int) -> None:
        self.trace = WindowTrace(k)

    def after_draft_token(self, drafted: int) -> bool:
        """Prefetch if `drafted` is a configured position; True when it did (the host read the counts)."""
        if drafted not in self.positions:
            return False
        rows = self.analyzer.ranking()  # layer -> [(expert, count)], most frequent first (one D2H copy)
        self.trace.boundaries.append(drafted)
        self.trace.phases.append(FIXED)
        self.trace.batch_sizes.append(issue_prefetches(self.cache, rows, self.trace.planned,
                                                       most_routed_first=False))
        return True

    def end_window(self) -> WindowPlan:
        """Clear the counters; keep the trace; the window's plan (no verification ranking)."""
        self.analyzer.elb.clear()
        self.traces.append(self.trace)
        return WindowPlan.of(self.trace)
