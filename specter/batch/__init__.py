"""Batched execution: B requests share one speculative pass, each with its own tokens, KV and acceptance."""
from .engine import generate_batch
from .state import BatchState

__all__ = ["BatchState", "generate_batch"]
