"""Target verification: the residency manager and expert-wise execution over offloaded experts."""
from specter.verify.residency import ResidencyManager

__all__ = ["ResidencyManager"]
