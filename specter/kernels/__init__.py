"""Expert computation: plain torch references (the fused INT4 Triton kernel joins them)."""
from specter.kernels.reference import expert_wise_moe, int4_moe_reference, token_wise_moe

__all__ = ["expert_wise_moe", "int4_moe_reference", "token_wise_moe"]
