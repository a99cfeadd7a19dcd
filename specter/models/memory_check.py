"""Before a model is built or loaded: does it fit in host RAM (and GPU memory)? One-line error if not."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import transformers

from specter.errors import SpecterError
from specter.models.registry import ModelSpec
from specter.device.budget import GB, plan_memory

MARGIN = 1.15  # allocator slack, quantization temporaries and the Python process itself
SKIP_ENV = "SPECTER_SKIP_MEMORY_CHECK"  # =1: build anyway (e.g. with a large swap file)


@dataclass(frozen=True)
class BuildNeed:
    """Bytes a build needs where it lives: host RAM and GPU memory, and the bytes of one layer's experts."""

    host: int
    gpu: int
    per_layer: int


def build_need(spec: ModelSpec, config: transformers.PretrainedConfig, device: torch.device, dtype: torch.dtype,
               experts_on_host: bool, encoded: bool = False) -> BuildNeed:
    """What building `spec` on `device` in `dtype` takes: every weight plus the INT4 draft, split between
    host and GPU as the build places them (experts_on_host: FP experts in host memory, the rest on the GPU;
    `encoded`: the host holds their residual blobs instead)."""
    plan = plan_memory(spec, config, dtype, kv_tokens=0, workspace_gb=0.0)
    experts = plan.expert_bytes * plan.num_moe_layers * plan.num_experts
    if experts_on_host and encoded:
        experts = int(RESIDUAL_BLOB_FRACTION * experts)
    rest = plan.non_expert_bytes + plan.draft_bytes
    per_layer = (experts + rest) // max(config.num_hidden_layers, 1)
    if torch.device(device).type != "cuda":
        return BuildNeed(host=int(MARGIN * (experts + rest)), gpu=0, per_layer=per_layer)
    if experts_on_host:
        return BuildNeed(host=int(MARGIN * experts), gpu=int(MARGIN * rest), per_layer=per_layer)
    return BuildNeed(host=0, gpu=int(MARGIN * (experts + rest)), per_layer=per_layer)


def experts_placement(spec: ModelSpec, config: transformers.PretrainedConfig, device: torch.device,
                      dtype: torch.dtype, gpu_free: int | None = None) -> tuple[bool, str]:
    """(experts_on_host, why): on a CUDA device whose free memory cannot hold the whole build, the FP experts
    are built (or loaded) straight into pinned host memory and never materialised on the GPU."""
    if torch.device(device).type != "cuda":
        return False, f"the model runs on the {torch.device(device).type}: one memory for everything"
    need = build_need(spec, config, device, dtype, experts_on_host=False).gpu
    free = available_gpu_bytes(device) if gpu_free is None else gpu_free
    if free is None or need <= free:
        return False, "the whole build fits on the GPU" + ("" if free is None else
                                                           f" ({need / GB:.1f} of {free / GB:.1f} GB free)")
    return True, (f"the whole build needs {need / GB:.1f} GB of GPU memory and {free / GB:.1f} GB is free: the experts "
                  f"go straight into pinned host memory")


# A residual blob's bytes over its raw expert's: bf16 measured 0.54-0.69 (results/reference/residual-bits), with room.
RESIDUAL_BLOB_FRACTION = 0.75


def host_need(spec: ModelSpec, config: transformers.PretrainedConfig, dtype: torch.dtype,
              residual: bool, keep_raw: bool = True, encoded: bool = False) -> dict[str, int]:
    """Bytes an offloaded run keeps in host memory at its peak, by part: the FP experts, their residual blobs
    (`residual`: residual transfer on; without `keep_raw` the raw layers go as they are encoded, so the peak
    holds the raw experts and one layer's blobs; `encoded`: the build encodes each layer before it reaches the
    host, which holds the blobs alone), and the staging, temporaries and process around them."""
    plan = plan_memory(spec, config, dtype, kv_tokens=0, workspace_gb=0.0)
    experts = plan.expert_bytes * plan.num_moe_layers * plan.num_experts
    need = {"FP experts": experts}
    if residual and encoded and not keep_raw:
        need = {"residual blobs": int(RESIDUAL_BLOB_FRACTION * experts)}
    elif residual and keep_raw:
        need["residual blobs"] = int(RESIDUAL_BLOB_FRACTION * experts)
    elif residual:
        need["a layer's residual blobs"] = int(RESIDUAL_BLOB_FRACTION * experts / plan.num_moe_layers)
    need["staging, temporaries and the process"] = int((MARGIN - 1) * sum(need.values()))
    return need


def check_host_memory(spec: ModelSpec, config: transformers.PretrainedConfig, dtype: torch.dtype, residual: bool,
                      keep_raw: bool = True, host_free: int | None = None, encoded: bool = False) -> None:
    """One-line SpecterError, before anything loads, when what an offloaded run keeps on the host does not fit the
    host's available memory: what is needed, by part, and what is free."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    parts = host_need(spec, config, dtype, residual, keep_raw, encoded)
    free = available_host_bytes() if host_free is None else host_free
    if free is None or sum(parts.values()) <= free:
        return
    listed = ", ".join(f"{name} {size / GB:.1f} GB" for name, size in parts.items())
    raise SpecterError(f"{spec.name} ({config.num_hidden_layers} layers, {str(dtype).removeprefix('torch.')}) keeps "
                       f"about {sum(parts.values()) / GB:.1f} GB in host memory ({listed}), but {free / GB:.1f} GB is "
                       f"available: model.layers=N builds fewer layers"
                       + (", systems=[specter] alone keeps the blobs and not the raw experts" if residual and keep_raw
                          else "")
                       + f", or set {SKIP_ENV}=1 to try anyway")


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_gpu_bytes(device: torch.device) -> int | None:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(torch.device(device))[0]


def check_build_memory(spec: ModelSpec, config: transformers.PretrainedConfig, device: torch.device,
                       dtype: torch.dtype, experts_on_host: bool, host_free: int | None = None,
                       gpu_free: int | None = None, encoded: bool = False) -> None:
    """Raise a one-line SpecterError naming the need and the ways out when the build cannot fit."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    need = build_need(spec, config, device, dtype, experts_on_host, encoded)
    host_free = available_host_bytes() if host_free is None else host_free
    gpu_free = available_gpu_bytes(device) if gpu_free is None else gpu_free
    what = f"{spec.name} ({config.num_hidden_layers} layers, {str(dtype).removeprefix('torch.')}) on {device}"
    ways = (f"model.layers=N builds fewer layers (about {need.per_layer / GB:.1f} GB each; library: num_layers=N), "
            f"a CUDA GPU with experts_on_host keeps only the FP experts in host RAM, or set {SKIP_ENV}=1 to try anyway")
    if host_free is not None and need.host > host_free:
        raise SpecterError(f"building {what} needs about {need.host / GB:.1f} GB of host RAM, but "
                           f"{host_free / GB:.1f} GB is available: {ways}")
    if gpu_free is not None and need.gpu > gpu_free:
        raise SpecterError(f"building {what} needs about {need.gpu / GB:.1f} GB of GPU memory, but "
                           f"{gpu_free / GB:.1f} GB is free: {ways}")
