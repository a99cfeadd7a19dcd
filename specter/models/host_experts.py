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
from specter.offload.residual_store import ResidualLayers, residual_dtype_problem
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
                  device: torch.device, residuals: ResidualLayers | None = None) -> None:
    """Quantize one layer's FP experts on `device` into the shell's INT4 draft and copy them into the store, or
    (`residuals`) encode them against that draft there: the store then never holds the layer raw."""
    gate_up, down = gate_up.to(device), down.to(device)  # [E, 2I, H], [E, H, I]
    shell.set_draft_weights(quantize_rtn(gate_up), quantize_rtn(down), device=device)
    if residuals is None:
        store.put_layer(shell.moe_layer, gate_up, down)
    else:
        residuals.add(gate_up, down, (shell.draft_gate_up, shell.draft_down))
        store.release_layer(shell.moe_layer)


def residual_layers(shells: list[HybridExperts], dtype: torch.dtype, keep_raw: bool) -> ResidualLayers | None:
    """Where the build encodes each layer as it comes (`keep_raw` False, 16-bit experts): the residual store's
    layers; None where the store keeps the raw experts."""
    if keep_raw or residual_dtype_problem(dtype):
        return None
    first = shells[0]
    return ResidualLayers(len(shells), first.num_experts, first.hidden_dim, first.intermediate_dim, dtype)


def finished(residuals: ResidualLayers | None):
    return None if residuals is None else residuals.finish()


def hybridize_to_host(hf_model: nn.Module, spec: ModelSpec, tokenizer: Any, device: torch.device,
                      keep_raw: bool = True) -> HybridMoEModel:
    """An HF model loaded on the CPU -> experts into the host store layer by layer, the rest onto `device`
    (without `keep_raw`: each layer encoded to residual blobs instead, the loader's copy freed as it goes)."""
    pairs = swap_in_shells(hf_model)
    shells = [shell for shell, _ in pairs]
    dtype = pairs[0][1].gate_up_proj.dtype
    store = HostExpertStore.for_experts(shells, dtype, device)
    residuals = residual_layers(shells, dtype, keep_raw)
    for shell, module in pairs:
        install_layer(shell, store, module.gate_up_proj.detach(), module.down_proj.detach(), device, residuals)
        del module.gate_up_proj, module.down_proj  # free the loader's copy of this layer
    hf_model.to(device).eval()
    return HybridMoEModel(hf_model, spec, tokenizer, shells, host_store=store, residual_store=finished(residuals))


def build_synthetic_on_host(spec: ModelSpec, config: transformers.PretrainedConfig, tokenizer: Any,
                            device: torch.device, dtype: torch.dtype, seed: int,
                            calibrated: bool = False, keep_raw: bool = True) -> HybridMoEModel:
    """Seeded random weights of a full-size architecture: non-expert weights initialised on the device,
    experts generated one layer at a time on the device, quantized there, and moved to the host store
    (calibrated: in the layout of specter/models/calibrated.py; without `keep_raw`: encoded to residual blobs
    there instead, so the host never holds the raw experts)."""
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
    residuals = residual_layers(shells, dtype, keep_raw)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    for shell in shells:
        e, h, i = shell.num_experts, shell.hidden_dim, shell.intermediate_dim
        gate_up = torch.randn(e, 2 * i, h, generator=generator, device=device, dtype=dtype) * std
        down = torch.randn(e, h, i, generator=generator, device=device, dtype=dtype) * std
        if clear is not None:
            down = clear(down, 1)  # [E, H, I]: no full-precision write along g (nor, if cleared, into routing)
        install_layer(shell, store, gate_up, down, device, residuals)
        del gate_up, down
    return HybridMoEModel(hf_model.eval(), spec, tokenizer, shells, host_store=store,
                          residual_store=finished(residuals))
