"""SpecMoEOff's two memory policies, same cache (SC) and matched memory (SM), and the harness factories."""
from __future__ import annotations

from baselines.specmoeoff.engine import SpecMoEOff, SpecMoEOffConfig
from specter.config import SpecterConfig
from specter.models.hybrid import HybridMoEModel
from specter.device.budget import MemoryPlan, plan_memory, specter_slots


def draft_copy_bytes(plan: MemoryPlan) -> int:
    """GPU bytes of SpecMoEOff's separate draft: a second copy of the non-expert weights, its INT4 experts
    (as large as Specter's draft) and its own KV cache (as large as the target's)."""
    return plan.non_expert_bytes + plan.draft_bytes + plan.kv_bytes


def matched_memory_slots(plan: MemoryPlan, slots: int) -> int:
    """FP slots per layer that give SpecMoEOff Specter's total GPU bytes: Specter's draft bytes minus the
    separate draft's, in whole slots of every layer (rounded down), added to Specter's; in 1..experts."""
    spare = plan.draft_bytes - draft_copy_bytes(plan)  # negative: the copy costs more than Specter's draft
    return max(1, min(plan.num_experts, slots + spare // (plan.num_moe_layers * plan.expert_bytes)))


def make_specmoeoff_sc(model: HybridMoEModel, specter_config: SpecterConfig, **options) -> SpecMoEOff:
    """Same cache: Specter's FP16 slots per layer."""
    return _make(model, specter_config, specter_slots(model, specter_config), "specmoeoff_sc", options)


def make_specmoeoff_sm(model: HybridMoEModel, specter_config: SpecterConfig, **options) -> SpecMoEOff:
    """Matched memory: Specter's total GPU bytes, the separate draft's weights and KV paid from the slots."""
    plan = plan_memory(model.spec, model.hf.config, model.dtype)
    slots = matched_memory_slots(plan, specter_slots(model, specter_config))
    return _make(model, specter_config, slots, "specmoeoff_sm", options)


def _make(model: HybridMoEModel, specter_config: SpecterConfig, slots: int, name: str, options: dict) -> SpecMoEOff:
    config = SpecMoEOffConfig(slots=slots, temperature=specter_config.temperature, top_p=specter_config.top_p,
                              seed=specter_config.seed, cuda_graph=specter_config.cuda_graph, **options)
    system = SpecMoEOff(model, config)
    system.name = name
    return system
