"""SpecMoEOff (arXiv 2508.21706), the main baseline, reimplemented from its paper's and the Specter paper's text."""
from baselines.specmoeoff.engine import SpecMoEOff, SpecMoEOffConfig
from baselines.specmoeoff.memory_policy import make_specmoeoff_sc, make_specmoeoff_sm, matched_memory_slots

__all__ = ["SpecMoEOff", "SpecMoEOffConfig", "make_specmoeoff_sc", "make_specmoeoff_sm", "matched_memory_slots"]
