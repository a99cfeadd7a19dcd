"""The target model as a plain HF model (or checkpoint directory) with exactly Specter's target weights.

Baselines that run another engine (Transformers with an Accelerate device map, vLLM, llama.cpp) start
from this, so every system decodes the same weights: the shared tensors of the hybrid model plus its
full-precision routed experts, wherever they live (on the device or in the host store). The INT4 draft
buffers are not part of it.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers
from torch import nn

from specter.errors import SpecterError
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import HybridExperts

DRAFT_PREFIX = "draft_"


def target_tensors(model: HybridMoEModel) -> dict[str, torch.Tensor]:
    """HF names -> the target's tensors (parameters and buffers), routed experts in HF's 3-D layout."""
    # remove_duplicate=False: after a forward, longrope's inv_freq and original_inv_freq can be one tensor
    named = [*model.hf.named_parameters(), *model.hf.named_buffers(remove_duplicate=False)]
    tensors = {name: t for name, t in named if not name.rpartition(".")[2].startswith(DRAFT_PREFIX)}
    expert_modules = [name for name, m in model.hf.named_modules() if isinstance(m, HybridExperts)]
    for name, module in zip(expert_modules, model.experts, strict=True):
        if model.host_store is not None:
            gate_up, down = model.host_store.layer_weights(module.moe_layer)  # [E, 2I, H], [E, H, I]
        else:
            gate_up, down = module.gate_up_proj, module.down_proj
        tensors[f"{name}.gate_up_proj"], tensors[f"{name}.down_proj"] = gate_up, down
    return tensors


@torch.no_grad()
def plain_hf_model(model: HybridMoEModel, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> nn.Module:
    """A fresh HF `*ForCausalLM` (no Specter modules) holding copies of the target's weights on `device`."""
    config = copy.deepcopy(model.hf.config)
    dtype = dtype or model.dtype
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.to_empty(device=device)
    source = target_tensors(model)
    for name, tensor in [*hf.named_parameters(), *hf.named_buffers(remove_duplicate=False)]:
        if name not in source:
            raise SpecterError(f"cannot export {type(hf).__name__}: no target tensor for {name}")
        tensor.copy_(source[name].to(device=device, dtype=tensor.dtype if tensor.is_floating_point() else None))
    hf.generation_config.eos_token_id = None  # compared systems always decode max_new_tokens (no early stop)
    return hf.eval()


def save_checkpoint(model: HybridMoEModel, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the target as an HF checkpoint directory (safetensors, per-expert keys as HF saves them).

    Synthetic models have a byte-level tokenizer, which is recorded in specter_tokenizer.json (engines
    that need a tokenizer get token ids directly). Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = plain_hf_model(model, "cpu", dtype)
    hf.save_pretrained(directory)
    if hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(directory)
    else:
        (directory / "specter_tokenizer.json").write_text(json.dumps(
            {"type": type(model.tokenizer).__name__, "vocab_size": model.hf.config.vocab_size}))
    return directory
