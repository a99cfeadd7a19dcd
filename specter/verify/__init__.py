"""Target verification: the residency manager, expert-wise execution over offloaded experts, acceptance."""
from specter.verify.accept import verify_and_accept, verify_batch
from specter.verify.residency import ResidencyManager, VerifyOptions

__all__ = ["ResidencyManager", "VerifyOptions", "verify_and_accept", "verify_batch"]
