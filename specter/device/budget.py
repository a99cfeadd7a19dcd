"""Memory budget: turn a GPU budget in GB into FP16 expert slots per MoE layer, after everything fixed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from specter.errors import SpecterError
from specter.models.hybrid_experts import is_hf_experts
from specter.models.registry import ModelSpec
from specter.quant.int4 import GROUP_SIZE

GB = 1024**3


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on the GPU: the fixed part (non-expert weights, INT4 draft, KV, workspace) plus the slots."""

    non_expert_bytes: int
    draft_bytes: int
    kv_bytes: int
    workspace_bytes: int  # activations, kernel buffers, spare rows (4 experts: 66 MiB on dsv2), residual staging
    expert_bytes: int  # one FP expert (gate_up + down)
    num_moe_layers: int
    num_experts: int

    @property
    def fixed_bytes(self) -> int:
        return self.non_expert_bytes + self.draft_bytes + self.kv_bytes + self.workspace_bytes

    def bytes_for(self, slots: int) -> int:
        return self.fixed_bytes + slots * self.num_moe_layers * self.expert_bytes

    def slots_for(self, budget_gb: float) -> int:
        """Most slots per layer that fit in `budget_gb` (at most every expert); raises if not even one fits."""
        free = budget_gb * GB - self.fixed_bytes
        slots = min(int(free // (self.num_moe_layers * self.expert_bytes)), self.num_experts)
        if slots < 1:
            raise SpecterError(
                f"a {budget_gb:g} GB GPU budget is too small: it needs at least {self.bytes_for(1) / GB:.2f} GB "
                f"(non-expert weights {self.non_expert_bytes / GB:.2f} + INT4 draft {self.draft_bytes / GB:.2f} "
                f"+ KV {self.kv_bytes / GB:.2f} + workspace {self.workspace_bytes / GB:.2f} "
                f"+ one FP expert slot per layer {self.num_moe_layers * self.expert_bytes / GB:.2f})")
        return slots


def specter_slots(model, config) -> int:
    """Specter's FP slots per layer under `config` (a SpecterConfig; every expert of `model` when it keeps
    them all resident)."""
    return config.resident_experts_per_layer or model.num_experts


def kv_bytes_per_token(config: transformers.PretrainedConfig, element_size: int) -> int:
    """HF DynamicCache bytes per token: DeepSeek-V2 caches the compressed latent (MLA), others K and V."""
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * element_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers * 2 * config.num_key_value_heads * head_dim * element_size


def plan_memory(spec: ModelSpec, config: transformers.PretrainedConfig, dtype: torch.dtype = torch.float16,
                kv_tokens: int = 4096, workspace_gb: float = 1.0) -> MemoryPlan:
    """The memory plan of a registered architecture, counted on the meta device (no allocation)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = [m for m in model.modules() if is_hf_experts(m)]
    element = torch.empty(0, dtype=dtype).element_size()
    expert_params = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    all_params = sum(p.numel() for p in model.parameters())
    e, two_i, h = experts[0].gate_up_proj.shape
    per_expert = 3 * (two_i // 2) * h  # weights of one expert
    draft_per_expert = per_expert // 2 + per_expert // GROUP_SIZE * element  # packed nibbles + scales
    return MemoryPlan(
        non_expert_bytes=(all_params - expert_params) * element,
        draft_bytes=draft_per_expert * e * len(experts),
        kv_bytes=kv_bytes_per_token(config, element) * kv_tokens,
        workspace_bytes=int(workspace_gb * GB),
        expert_bytes=per_expert * element,
        num_moe_layers=len(experts),
        num_experts=e,
    )
