"""Draft-time expert prediction: lookahead counters, pattern analyzer, layer-aware prefetch planner."""
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import COLD_START, FINAL_CLEANUP, PREFETCH_OVERLAP, CostModel, PrefetchPlanner

__all__ = ["COLD_START", "FINAL_CLEANUP", "PREFETCH_OVERLAP", "CostModel", "ExpertLookaheadBuffer",
           "PatternAnalyzer", "PrefetchPlanner"]
