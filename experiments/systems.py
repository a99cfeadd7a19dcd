"""Instantiate the compared systems from their conf/system/<name>.yaml option files (`_target_`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import hydra.utils
from omegaconf import OmegaConf

from baselines.base import System
from baselines.target_only import TargetOnly
from experiments.settings import specter_options
from specter.config import PAPER_DESIGN, SpecterConfig
from specter.engine import SpecterEngine
from specter.errors import SpecterError
from specter.models.hybrid import HybridMoEModel

SYSTEM_CONF = Path(__file__).resolve().parent.parent / "conf" / "system"


def known_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEM_CONF.glob("*.yaml"))


def system_options(name: str):
    """conf/system/<name>.yaml, or a one-line error naming the known systems."""
    path = SYSTEM_CONF / f"{name}.yaml"
    if not path.is_file():
        raise SpecterError(f"unknown system {name!r}; known systems: {', '.join(known_systems())}")
    return OmegaConf.load(path)


def build_system(name: str, model: HybridMoEModel, config: SpecterConfig, keep_raw: bool = True):
    """The system named `name`, built on `model` with the run's Specter config (memory budget, K, the
    `specter` group's options) and, on top of it, the option file's own `specter:` block (an ablation's
    difference, e.g. `specter: {prefetch: false}`): the factory is called with the resulting config.
    `keep_raw=False` (every system of the run is Specter with residual transfer: run_model.keep_raw_experts) lets the
    host's raw experts go once encoded."""
    options = system_options(name)
    overrides = specter_options(options.pop("specter", None), f"conf/system/{name}.yaml: ")
    config = dataclasses.replace(config, **overrides)  # SpecterConfig checks the values again
    factory = hydra.utils.instantiate(options, _partial_=True)
    extra = {} if keep_raw else {"keep_raw_experts": False}  # only make_specter's runs get here
    system = factory(model=model, specter_config=config, **extra)
    if not isinstance(system, System):
        raise SpecterError(f"conf/system/{name}.yaml builds a {type(system).__name__}, which lacks the System "
                           f"contract (name, available(), generate(); baselines.base.System)")
    system.name = name  # rows are labelled by the option file (ablations share a class)
    return system


def make_specter(model: HybridMoEModel, specter_config: SpecterConfig, keep_raw_experts: bool = True) -> SpecterEngine:
    """Specter with the run's config (an ablation's option file has already set its fields)."""
    return SpecterEngine(model, specter_config, keep_raw_experts)


def make_specter_paper(model: HybridMoEModel, specter_config: SpecterConfig) -> SpecterEngine:
    """Specter as the paper designs it: the run's config with this project's mechanisms off
    (`SpecterConfig.paper()`); the paper's ablations set their one field on top of it."""
    return SpecterEngine(model, dataclasses.replace(specter_config, **PAPER_DESIGN))


def make_target_only(model: HybridMoEModel, specter_config: SpecterConfig) -> TargetOnly:
    return TargetOnly(model, specter_config.resident_experts_per_layer)
