"""Compared systems behind one generate() contract (see baselines.base.System)."""
from baselines.target_only import TargetOnly

__all__ = ["TargetOnly"]
