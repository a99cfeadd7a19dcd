"""Specter's replacement for an HF `*Experts` module: INT4 draft experts and full-precision target experts."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specter.kernels.int4_decode import DECODE_MAX_PAIRS, int4_moe_decode
from specter.kernels.int4_moe import TRITON_AVAILABLE, MoEWorkspace, fused_int4_moe
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
    observer (the expert lookahead buffer). mode "target": the full-precision experts, expert-wise, or through
    `target_executor` once they are offloaded (the runtime's residency manager, or the executor a target forward
    was given: HybridMoEModel.forward(executor=...)).
    """

    def __init__(self, moe_layer: int, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn) -> None:
        super().__init__()
        self.moe_layer, self.num_experts = moe_layer, num_experts
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim
        self.act_fn = act_fn
        self.mode = TARGET
        self.routing_observer: RoutingObserver | None = None
        self.target_executor: TargetExecutor | None = None
        # The fused draft kernel's buffers (None: its own per call). An engine installs its own on every
        # layer for the duration of a call: a draft graph it captured points into them.
        self.draft_workspace: MoEWorkspace | None = None
        self.draft_decode_pairs = DECODE_MAX_PAIRS  # up to this many routed pairs: the GEMV decode kernel

    @classmethod
    def from_hf(cls, hf_experts: nn.Module, moe_layer: int) -> HybridExperts:
        """Take over an HF experts module: its FP parameters become the target weights (no copy),
        their RTN INT4 quantization the draft weights."""
        e, two_i, h = hf_experts.gate_up_proj.shape
        module = cls(moe_layer, e, h, two_i // 2, hf_experts.act_fn)
        module.gate_up_proj = hf_experts.gate_up_proj  # [E, 2I, H]
        module.down_proj = hf_experts.down_proj  # [E, H, I]
        module.set_draft_weights(quantize_rtn(module.gate_up_proj.detach()), quantize_rtn(module.down_proj.detach()))
        return module

    def set_draft_weights(self, gate_up: Int4Linear, down: Int4Linear, device=None) -> None:
        """Install packed INT4 draft weights (RTN, or GPTQ from a file) on `device` (default: where they were)."""
        old = getattr(self, "draft_gate_up_qweight", None)
        device = device or (old.device if old is not None else gate_up.qweight.device)
        self.group_size = gate_up.group_size
        for name, packed in (("draft_gate_up", gate_up), ("draft_down", down)):
            self.register_buffer(f"{name}_qweight", packed.qweight.to(device))
            self.register_buffer(f"{name}_scales", packed.scales.to(device))

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
            return self.draft_experts(hidden, top_k_index, top_k_weights)
        if self.target_executor is not None:
            return self.target_executor(self, hidden, top_k_index, top_k_weights)
        return expert_wise_moe(hidden, top_k_index, top_k_weights, self.target_weights, self.num_experts,
                               self.act_fn)

    def draft_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """INT4 routed experts through the kernel `draft_kernel` picks."""
        kernel = draft_kernel(hidden.is_cuda and TRITON_AVAILABLE, top_k_index.numel(), self.draft_decode_pairs)
        if kernel == "decode":
            return int4_moe_decode(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down,
                                   self.act_fn, workspace=self.draft_workspace)
        if kernel == "tiled":
            return fused_int4_moe(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down,
                                  self.act_fn, workspace=self.draft_workspace)
        return int4_moe_reference(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down, self.act_fn)

    def extra_repr(self) -> str:
        return (f"moe_layer={self.moe_layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, mode={self.mode}")


def draft_kernel(triton_on_cuda: bool, pairs: int, decode_pairs: int) -> str:
    """The draft's INT4 expert kernel for `pairs` routed (token, slot) pairs: "decode" (Triton GEMV) up to
    `decode_pairs`, "tiled" (the fused Triton kernel) beyond, "reference" (torch) without Triton on CUDA."""
    if not triton_on_cuda:
        return "reference"
    return "decode" if pairs <= decode_pairs else "tiled"
