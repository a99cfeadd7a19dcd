"""Build hybrid models whose FP experts go straight into the host store, never all on the device at once."""
from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from specter.models.calibrated import calibrate, moe_layer_count, routing_profile, special_ids
from specter.models.hybrid import HybridMoEModel, hf_experts_modules, replace_module
from specter.models.hybrid_experts import HybridExperts
from specter.models.registry import ModelSpec
from specter.offload.host_store import HostExpertStore
from specter.quant.int4 import quantize_rtn


def swap_in_shells(hf_model: nn.Module) -> list[tuple[HybridExperts, nn.Module]]:
    """Replace each HF experts module by a weightless HybridExperts; returns (shell, detached HF module) pairs."""
    pairs = []
    for moe_layer, (name, module) in enumerate(hf_experts_modules(hf_model)):
        e, two_i, h = module.gate_up_proj.shape
        shell = HybridExperts(moe_layer, e, h, two_i // 2, module.act_fn)
        replace_module(hf_model, name, shell)
        pairs.append((shell, module))
    return pairs


def install_layer(shell: HybridExperts, store: HostExpertStore, gate_up: torch.Tensor, down: torch.Tensor,
                  device: torch.device) -> None:
    """Quantize one layer's FP experts on `device` into the shell's INT4 draft and copy them into the store."""
    gate_up, down = gate_up.to(device), down.to(device)  # [E, 2I, H], [E, H, I]
    shell.set_draft_weights(quantize_rtn(gate_up), quantize_rtn(down), device=device)
    store.put_layer(shell.moe_layer, gate_up, down)


def hybridize_to_host(hf_model: nn.Module, spec: ModelSpec, tokenizer: Any, device: torch.device) -> HybridMoEModel:
    """An HF model loaded on the CPU -> experts into the host store layer by layer, the rest onto `device`."""
    pairs = swap_in_shells(hf_model)
    dtype = pairs[0][1].gate_up_proj.dtype
    store = HostExpertStore.for_experts([shell for shell, _ in pairs], dtype, device)
    for shell, module in pairs:
        install_layer(shell, store, module.gate_up_proj.detach(), module.down_proj.detach(), device)
        del module.gate_up_proj, module.down_proj  # free the loader's copy of this layer
    hf_model.to(device).eval()
    return HybridMoEModel(hf_model, spec, tokenizer, [shell for shell, _ in pairs], host_store=store)


def build_synthetic_on_host(spec: ModelSpec, config: transformers.PretrainedConfig, tokenizer: Any,
                            device: torch.device, dtype: torch.dtype, seed: int,
                            calibrated: bool = False) -> HybridMoEModel:
    """Seeded random weights of a full-size architecture: non-expert weights initialised on the device,
    experts generated one layer at a time on the device, quantized there, and moved to the host store
    (calibrated: in the layout of specter/models/calibrated.py)."""
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    shells = [shell for shell, _ in swap_in_shells(hf_model)]
    hf_model.to_empty(device=device)
    torch.manual_seed(seed)
    hf_model.initialize_weights()
    clear = None
    if calibrated:
        clear = calibrate(hf_model, routing_profile(spec), special_ids(config), moe_layer_count(config), seed)
    store = HostExpertStore.for_experts(shells, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    for shell in shells:
        e, h, i = shell.num_experts, shell.hidden_dim, shell.intermediate_dim
        gate_up = torch.randn(e, 2 * i, h, generator=generator, device=device, dtype=dtype) * std
        down = torch.randn(e, h, i, generator=generator, device=device, dtype=dtype) * std
        if clear is not None:
            down = clear(down, 1)  # [E, H, I]: no full-precision write along g (nor, if cleared, into routing)
        install_layer(shell, store, gate_up, down, device)
        del gate_up, down
    return HybridMoEModel(hf_model.eval(), spec, tokenizer, shells, host_store=store)
