"""The run's model: what it loads, where its FP experts live (device or host; raw beside their residual blobs or not,
together or one phase after the other) and the load itself."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from experiments.settings import ModelChoice, checkpoint_path, model_choice, specter_config
from experiments.systems import system_config
from specter.config import SpecterConfig
from specter.models.loading import checkpoint_spec, default_device, default_dtype, hf_config, load_model, with_layers
from specter.offload.residual_store import residual_dtype_problem
from specter.models.memory_check import available_host_bytes, check_host_memory, experts_placement, host_need

SYSTEMS = Path(__file__).resolve().parent.parent / "conf" / "system"


def run_model(cfg, choice: ModelChoice) -> tuple:
    """(spec, HF config, dtype, device) the run will load, read before loading (a checkpoint's from its config)."""
    device = torch.device(choice.device) if choice.device is not None else default_device()
    if not choice.synthetic:
        return (*checkpoint_spec(checkpoint_path(cfg), device, choice.dtype), device)
    spec = with_layers(choice.spec, choice.layers)
    return spec, hf_config(spec), choice.dtype or default_dtype(device), device


def reads_raw_experts(name: str, config: SpecterConfig) -> bool:
    """Does system `name` read the raw experts from the host (everything but Specter with residual transfer)?
    An unknown name counts as reading them (building it fails with its own error)."""
    path = SYSTEMS / f"{name}.yaml"
    if not path.is_file():
        return True
    if OmegaConf.load(path).get("_target_") != "experiments.systems.make_specter":
        return True
    return not system_config(name, config).residual_transfer


def keep_raw_experts(names: list[str], config: SpecterConfig) -> bool:
    """The host keeps the raw experts unless every system of the run reads residual blobs only (then it keeps
    the blobs alone: about half the host memory in bf16)."""
    return not names or any(reads_raw_experts(name, config) for name in names)


def expert_placement(cfg) -> dict:
    """Where the run's FP experts are built or loaded (run.json `experts`): {"on": "host" | "device", "why"}, the
    choice load_model makes by default (`memory_check.experts_placement`), decided before anything loads, and
    whether the host keeps the raw experts beside their residual blobs ("raw", `keep_raw_experts`)."""
    choice = model_choice(cfg)
    spec, config, dtype, device = run_model(cfg, choice)
    on_host, why = experts_placement(spec, config, device, dtype)
    plan = host_plan(cfg, specter_config(cfg, choice.spec))
    raw = "kept" if plan.keep_raw else "let go as encoded: every system reads residual blobs"
    if not plan.keep_raw and on_host and choice.synthetic and not residual_dtype_problem(dtype):
        raw = "never held: each layer is encoded on the GPU as it is built (every system reads residual blobs)"
    if plan.phased:
        raw = ("kept for the systems that read them, then let go as encoded for those that read residual blobs: "
               "measured one after another (the host cannot hold both)")
    return {"on": "host" if on_host else "device", "why": why, "raw": raw}


@dataclass(frozen=True)
class HostPlan:
    """How the run's systems share host memory: `keep_raw` (the raw experts stay beside the residual blobs) and
    `phased` (the systems that read raw experts run every case first; then the raw experts go as they are
    encoded and those that read residual blobs run: the host cannot hold both forms at once)."""

    keep_raw: bool = True
    phased: bool = False


def host_plan(cfg, config: SpecterConfig) -> HostPlan:
    """The run's HostPlan, from its systems and, for an offloaded run, the host's available memory."""
    names = list(cfg.get("systems") or [])
    keep_raw = keep_raw_experts(names, config)
    if not (keep_raw and config.residual_transfer and config.resident_experts_per_layer):
        return HostPlan(keep_raw)
    if all(reads_raw_experts(name, config) for name in names):
        return HostPlan(keep_raw)
    spec, hf, dtype, _ = run_model(cfg, model_choice(cfg))
    need = sum(host_need(spec, hf, dtype, True).values())
    free = available_host_bytes()
    return HostPlan(keep_raw, phased=free is not None and need > free)


def load(cfg):
    """(model, SpecterConfig) of the run (`load_run`)."""
    model, config, _ = load_run(cfg)
    return model, config


def load_run(cfg) -> tuple:
    """(model, SpecterConfig, HostPlan) of the run; first, whether what it keeps in host memory fits
    (`check_host_memory`, for the plan: both forms at once, or one after the other)."""
    choice = model_choice(cfg)
    config = specter_config(cfg, choice.spec)
    plan = host_plan(cfg, config)
    if config.resident_experts_per_layer is not None:
        spec, hf, dtype, device = run_model(cfg, choice)
        encoded = not (plan.keep_raw or residual_dtype_problem(dtype)) and choice.synthetic and \
            experts_placement(spec, hf, device, dtype)[0]
        check_host_memory(spec, hf, dtype, config.residual_transfer, plan.keep_raw and not plan.phased,
                          encoded=encoded)
    model = load_model(choice.source, device=choice.device, dtype=choice.dtype, seed=config.seed,
                       draft=choice.draft, weights=choice.weights if choice.synthetic else None,
                       num_layers=choice.layers, tokenizer=choice.tokenizer, keep_raw_experts=plan.keep_raw)
    return model, config, plan
