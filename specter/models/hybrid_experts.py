"""Specter's replacement for an HF `*Experts` module: INT4 draft experts and full-precision target experts."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specter.kernels.reference import expert_wise_moe, int4_moe_reference
from specter.quant.int4 import Int4Linear, quantize_rtn

DRAFT, TARGET = "draft", "target"

RoutingObserver = Callable[[int, torch.Tensor], None]  # (moe_layer, top_k_index [T, k])
TargetExecutor = Callable[["HybridExperts", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def is_hf_experts(module: nn.Module) -> bool:
    """True for the transformers 5.x routed-experts modules (3-D gate_up_proj / down_proj)."""
    gate_up = getattr(module, "gate_up_proj", None)
    return type(module).__name__.endswith("Experts") and isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3


class HybridExperts(nn.Module):
    """Same forward signature as the HF module it replaces: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]).

    mode "draft": INT4 weights (GPTQ layout) through the draft expert kernel; routing is reported to the
    observer (the expert lookahead buffer). mode "target": the full-precision experts, expert-wise, or
    through `target_executor` when the offload runtime installs one.
    """

    def __init__(self, hf_experts: nn.Module, moe_layer: int, draft: tuple[Int4Linear, Int4Linear] | None = None):
        super().__init__()
        self.moe_layer = moe_layer
        self.num_experts, two_i, self.hidden_dim = hf_experts.gate_up_proj.shape
        self.intermediate_dim = two_i // 2
        self.act_fn = hf_experts.act_fn
        self.gate_up_proj = hf_experts.gate_up_proj  # [E, 2I, H], the target's tensor itself (no copy)
        self.down_proj = hf_experts.down_proj  # [E, H, I]
        gate_up_q, down_q = draft or (quantize_rtn(self.gate_up_proj.detach()), quantize_rtn(self.down_proj.detach()))
        self.set_draft_weights(gate_up_q, down_q)
        self.mode = TARGET
        self.routing_observer: RoutingObserver | None = None
        self.target_executor: TargetExecutor | None = None

    def set_draft_weights(self, gate_up: Int4Linear, down: Int4Linear) -> None:
        """Install packed INT4 draft weights (from RTN here, or from a GPTQ file)."""
        self.group_size = gate_up.group_size
        for name, packed in (("draft_gate_up", gate_up), ("draft_down", down)):
            self.register_buffer(f"{name}_qweight", packed.qweight.to(self.gate_up_proj.device))
            self.register_buffer(f"{name}_scales", packed.scales.to(self.gate_up_proj.device))

    @property
    def draft_gate_up(self) -> Int4Linear:
        return Int4Linear(self.draft_gate_up_qweight, self.draft_gate_up_scales, self.group_size)

    @property
    def draft_down(self) -> Int4Linear:
        return Int4Linear(self.draft_down_qweight, self.draft_down_scales, self.group_size)

    def target_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj[expert], self.down_proj[expert]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.mode == DRAFT:
            if self.routing_observer is not None:
                self.routing_observer(self.moe_layer, top_k_index)
            return int4_moe_reference(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down,
                                      self.act_fn)
        if self.target_executor is not None:
            return self.target_executor(self, hidden, top_k_index, top_k_weights)
        return expert_wise_moe(hidden, top_k_index, top_k_weights, self.target_weights, self.num_experts,
                               self.act_fn)

    def extra_repr(self) -> str:
        return (f"moe_layer={self.moe_layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, mode={self.mode}")
