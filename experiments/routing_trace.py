"""The routing of a committed sequence: one teacher-forced forward, top-k ids per MoE layer and token."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import DynamicCache

from specter.models.hybrid_experts import TARGET


@contextmanager
def recording_routing(model, mode: str, out: list[list[torch.Tensor]]):
    """While inside, every `mode` expert call appends its top_k_index [T, k] to out[moe_layer]."""
    def hook(module, args):
        if module.mode == mode:
            out[module.moe_layer].append(args[1].detach().cpu())

    handles = [m.register_forward_pre_hook(hook) for m in model.experts]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def committed_routing(model, prompt: torch.Tensor, generated: list[int], mode: str = TARGET) -> list[list[list[int]]]:
    """[moe_layer][token][k] expert ids (rank order) that `mode`'s routers pick for each generated token, from
    one forward over prompt + generated (the tokens a decode committed)."""
    ids = torch.cat([prompt.reshape(1, -1).cpu(), torch.tensor([generated], dtype=torch.long)], dim=1)
    calls: list[list[torch.Tensor]] = [[] for _ in model.experts]
    with recording_routing(model, mode, calls):
        model.forward(ids.to(model.device), DynamicCache(config=model.hf.config), mode=mode)
    start = prompt.numel()
    return [torch.cat(layer)[start:].tolist() for layer in calls]  # [T, k] per layer, generated part


def topk_recall(draft: list[list[list[int]]], target: list[list[list[int]]]) -> float:
    """Mean fraction of the target's top-k experts that the draft's routing also picks, per token and layer."""
    hits = total = 0
    for draft_layer, target_layer in zip(draft, target):
        for d, t in zip(draft_layer, target_layer):
            hits += len(set(d) & set(t))
            total += len(t)
    return hits / max(total, 1)
