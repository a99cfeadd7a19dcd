"""Instantiate the compared systems from their conf/system/<name>.yaml option files (`_target_`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import hydra.utils
from omegaconf import OmegaConf

from baselines.target_only import TargetOnly
from specter.config import SpecterConfig
from specter.engine import SpecterEngine
from specter.errors import SpecterError
from specter.models.hybrid import HybridMoEModel

SYSTEM_CONF = Path(__file__).resolve().parent.parent / "conf" / "system"


def known_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEM_CONF.glob("*.yaml"))


def build_system(name: str, model: HybridMoEModel, config: SpecterConfig):
    """The system named `name`, built on `model` with the run's Specter config (memory budget, K)."""
    path = SYSTEM_CONF / f"{name}.yaml"
    if not path.is_file():
        raise SpecterError(f"unknown system {name!r}; known systems: {', '.join(known_systems())}")
    factory = hydra.utils.instantiate(OmegaConf.load(path), _partial_=True)
    system = factory(model=model, specter_config=config)
    system.name = name  # rows are labelled by the option file (ablations share a class)
    return system


def make_specter(model: HybridMoEModel, specter_config: SpecterConfig, **ablation) -> SpecterEngine:
    """Specter with the run's config, optionally with ablation switches (prefetch, expert_wise, ...)."""
    return SpecterEngine(model, dataclasses.replace(specter_config, **ablation))


def make_target_only(model: HybridMoEModel, specter_config: SpecterConfig) -> TargetOnly:
    return TargetOnly(model, specter_config.resident_experts_per_layer)
