"""Draft-time expert prediction: lookahead counters, pattern analyzer, layer-aware prefetch planner, window plans."""
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer, Ranking
from specter.prefetch.planner import (
    COLD_START,
    FINAL_CLEANUP,
    PREFETCH_OVERLAP,
    CostModel,
    PrefetchPlanner,
    WindowPlan,
    issue_prefetches,
)

__all__ = ["COLD_START", "FINAL_CLEANUP", "PREFETCH_OVERLAP", "CostModel", "ExpertLookaheadBuffer",
           "PatternAnalyzer", "PrefetchPlanner", "Ranking", "WindowPlan", "issue_prefetches"]
