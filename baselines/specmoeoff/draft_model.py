"""SpecMoEOff's draft: a separate model instance (its own non-expert weights and INT4 routed experts)."""
from __future__ import annotations

import copy

import torch
import transformers

from specter.errors import SpecterError
from specter.kernels.int4_moe import TRITON_AVAILABLE, MoEWorkspace, fused_int4_moe
from specter.kernels.reference import int4_moe_reference
from specter.models.hybrid import HybridMoEModel, hf_experts_modules, replace_module
from specter.models.hybrid_experts import HybridExperts
from specter.quant.int4 import Int4Linear


class DraftExperts(HybridExperts):
    """Routed experts of the separate draft: INT4 only, whatever the mode, with their own kernel workspace.

    One-token steps use `draft_workspace` (the SpecMoEOff engine's; it never grows after a graph capture);
    multi-token forwards (prefill, catching up after a fully accepted window) allocate their own buffers.
    """

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.routing_observer is not None:
            self.routing_observer(self.moe_layer, top_k_index)
        return self.draft_experts(hidden, top_k_index, top_k_weights)

    def draft_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if hidden.is_cuda and TRITON_AVAILABLE:
            workspace = self.draft_workspace if hidden.shape[0] == 1 else None
            return fused_int4_moe(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down,
                                  self.act_fn, workspace=workspace)
        return int4_moe_reference(hidden, top_k_index, top_k_weights, self.draft_gate_up, self.draft_down, self.act_fn)


@torch.no_grad()
def build_draft(model: HybridMoEModel, workspace: MoEWorkspace) -> HybridMoEModel:
    """A second instance of the architecture on the target's device: copies of every non-expert tensor and
    of the target's INT4 expert weights (the same quantization as Specter's draft), no FP experts; its
    one-token draft steps use `workspace`.

    Nothing is shared with `model`: the draft has its own storage and, when decoding, its own KV cache.
    """
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.hf.config), dtype=model.dtype)
    experts = []
    for (name, module), source in zip(hf_experts_modules(hf), model.experts, strict=True):
        experts.append(DraftExperts(source.moe_layer, source.num_experts, source.hidden_dim,
                                    source.intermediate_dim, module.act_fn))
        experts[-1].draft_workspace = workspace
        replace_module(hf, name, experts[-1])  # before allocation: the FP experts are never materialised
    hf.to_empty(device=model.device)
    _copy_non_expert(hf, model)
    for module, source in zip(experts, model.experts, strict=True):
        module.set_draft_weights(_clone(source.draft_gate_up), _clone(source.draft_down))
    return HybridMoEModel(hf.eval(), model.spec, model.tokenizer, experts, model.quantizer)


def _copy_non_expert(hf: torch.nn.Module, model: HybridMoEModel) -> None:
    """Fill every parameter and buffer of the fresh draft from the target tensor of the same name."""
    source = {**dict(model.hf.named_parameters()), **dict(model.hf.named_buffers())}
    for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
        if name not in source:
            raise SpecterError(f"cannot build the SpecMoEOff draft: the target has no tensor {name}")
        tensor.copy_(source[name])


def _clone(packed: Int4Linear) -> Int4Linear:
    return Int4Linear(packed.qweight.clone(), packed.scales.clone(), packed.group_size)


def draft_tensors(draft: HybridMoEModel) -> list[torch.Tensor]:
    """Every tensor the draft holds (parameters and buffers, INT4 experts included)."""
    return [*draft.hf.parameters(), *draft.hf.buffers()]
