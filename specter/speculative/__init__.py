"""Speculative decoding state: KV commit/rollback and acceptance rules."""
from specter.speculative.sampling import greedy_accept, logits_to_probs, rejection_accept, sample
from specter.speculative.state import StateManager, crop_cache

__all__ = ["StateManager", "crop_cache", "greedy_accept", "logits_to_probs", "rejection_accept", "sample"]
