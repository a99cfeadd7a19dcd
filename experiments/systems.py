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


def system_config(name: str, run: SpecterConfig) -> SpecterConfig:
    """The SpecterConfig system `name` decodes with, built once from the run's (memory budget, K, the `specter`
    group's options): with `design: paper` in its option file the paper's design (`specter.config.PAPER_DESIGN`:
    this project's mechanisms off), and the file's own `specter:` block on top (an ablation's difference, e.g.
    `specter: {prefetch: false}`). SpecterConfig checks the values."""
    options = system_options(name)
    design = options.get("design")
    if design not in (None, "paper"):
        raise SpecterError(f"conf/system/{name}.yaml: design must be paper (or absent), got {design!r}")
    overrides = specter_options(options.get("specter"), f"conf/system/{name}.yaml: ")
    return dataclasses.replace(run, **{**(PAPER_DESIGN if design == "paper" else {}), **overrides})


def build_system(name: str, model: HybridMoEModel, config: SpecterConfig, keep_raw: bool = True):
    """The system named `name`, built on `model`: its option file's factory (`_target_`) called with the system's
    config (`system_config`: the run's `config`, its design and its `specter:` block). `keep_raw=False` (every
    system of the run is Specter with residual transfer: run_model.keep_raw_experts) lets the host's raw experts
    go once encoded."""
    options = OmegaConf.to_container(system_options(name))
    for key in ("specter", "design"):
        options.pop(key, None)
    factory = hydra.utils.instantiate(options, _partial_=True)
    extra = {} if keep_raw else {"keep_raw_experts": False}  # only make_specter's runs get here
    system = factory(model=model, specter_config=system_config(name, config), **extra)
    if not isinstance(system, System):
        raise SpecterError(f"conf/system/{name}.yaml builds a {type(system).__name__}, which lacks the System "
                           f"contract (name, available(), generate(); baselines.base.System)")
    system.name = name  # rows are labelled by the option file (ablations share a class)
    return system


def make_specter(model: HybridMoEModel, specter_config: SpecterConfig, keep_raw_experts: bool = True) -> SpecterEngine:
    """Specter with the system's config (`system_config`: the default design, or the paper's, with an ablation's
    fields)."""
    return SpecterEngine(model, specter_config, keep_raw_experts)


def make_target_only(model: HybridMoEModel, specter_config: SpecterConfig) -> TargetOnly:
    return TargetOnly(model, specter_config.resident_experts_per_layer)
