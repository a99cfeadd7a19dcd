"""Turn a composed Hydra config into plain values: the model to load, the memory budget, the Specter config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.models.loading import hf_config
from specter.models.registry import ModelSpec, get_spec
from specter.offload.budget import plan_memory

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelChoice:
    """Which model to load and how."""

    spec: ModelSpec
    synthetic: bool
    checkpoint: str | None
    device: str | None
    dtype: torch.dtype | None
    draft: str | None = None

    @property
    def source(self) -> str:
        return self.checkpoint or self.spec.name


def model_choice(cfg) -> ModelChoice:
    spec = get_spec(cfg.model.name)
    if cfg.model.weights not in ("synthetic", "checkpoint"):
        raise SpecterError(f"model.weights must be 'synthetic' or 'checkpoint', got {cfg.model.weights!r}")
    synthetic = cfg.model.weights == "synthetic"
    if spec.is_tiny and not synthetic:
        raise SpecterError(f"{spec.name} is a tiny synthetic model; it has no checkpoint (use model.weights=synthetic)")
    device = None if cfg.device == "auto" else cfg.device
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise SpecterError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    checkpoint = None if synthetic or cfg.model.checkpoint is None else str(cfg.model.checkpoint)
    draft = None if cfg.model.get("draft") is None else str(cfg.model.draft)
    return ModelChoice(spec, synthetic, checkpoint, device, dtype, draft)


def resident_slots(cfg, spec: ModelSpec) -> int:
    """Resident FP16 experts per MoE layer: mem.slots, else a GPU budget mem.gb, else the named preset."""
    if cfg.mem.slots is not None:
        return int(cfg.mem.slots)
    if cfg.mem.get("gb") is not None:
        dtype = DTYPES.get(cfg.dtype, torch.float16)
        return plan_memory(spec, hf_config(spec), dtype).slots_for(float(cfg.mem.gb))
    try:
        return spec.mem_presets[cfg.mem.preset]
    except KeyError:
        known = ", ".join(spec.mem_presets)
        raise SpecterError(f"{spec.name} has no memory preset {cfg.mem.preset!r}; known: {known}") from None


def specter_config(cfg, spec: ModelSpec) -> SpecterConfig:
    k = spec.default_k if cfg.k is None else cfg.k
    return SpecterConfig(k=k, resident_experts_per_layer=resident_slots(cfg, spec),
                         temperature=float(cfg.temperature), seed=int(cfg.seed))


def results_dir(cfg, spec: ModelSpec) -> Path:
    """Where this run writes; never an existing directory.

    An explicit results_dir that exists is refused; the default results/<experiment>/<model>-<mem>
    gets a numeric suffix (.1, .2, ...) instead, so repeated runs keep every earlier result.
    """
    if cfg.results_dir is not None:
        path = Path(cfg.results_dir)
        if path.exists():
            raise SpecterError(f"results directory {path} already exists; it is never overwritten: "
                               f"pass another results_dir=")
        return path
    base = Path("results") / cfg.experiment / f"{spec.name}-{cfg.mem.name}"
    path, n = base, 0
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}.{n}")
    return path
