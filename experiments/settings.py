"""Turn a composed Hydra config into plain values: the model to load, the memory budget, the Specter config."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from experiments import provenance
from experiments.machine import machine_state
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.models.calibrated import routing_profile
from specter.models.loading import WEIGHTS, check_architecture, checkpoint_dir, hf_config, with_layers
from specter.models.registry import ModelSpec, get_spec
from specter.device.budget import plan_memory

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
    weights: str = "checkpoint"  # checkpoint | synthetic | calibrated
    layers: int | None = None  # synthetic/calibrated depth override
    tokenizer: str = "auto"  # checkpoints: auto (their own) or byte

    @property
    def source(self) -> str:
        return self.checkpoint or self.spec.name


def model_choice(cfg) -> ModelChoice:
    spec = get_spec(cfg.model.name)
    if cfg.model.weights not in WEIGHTS:
        raise SpecterError(f"model.weights must be one of {', '.join(WEIGHTS)}, got {cfg.model.weights!r}")
    synthetic = cfg.model.weights != "checkpoint"
    if synthetic and cfg.model.checkpoint is not None:
        raise SpecterError(f"model.checkpoint={cfg.model.checkpoint} is given but model.weights={cfg.model.weights} "
                           f"builds seeded weights: pass model.weights=checkpoint (full-size models) or drop "
                           f"model.checkpoint")
    layers = cfg.model.get("layers")
    if layers is not None and not synthetic:
        raise SpecterError("model.layers rebuilds the architecture at another depth: it needs model.weights=synthetic "
                           "or calibrated")
    if cfg.model.weights == "calibrated":
        routing_profile(spec)
    if not synthetic and not spec.is_tiny and cfg.model.checkpoint is None and not checkpoint_dir(spec).exists():
        raise SpecterError(f"no checkpoint for {spec.name!r} at {checkpoint_dir(spec)}: run `python "
                           f"initialization/download_models.py --manifest initialization/model-assets.json --output "
                           f"DIR --only {spec.name}` and set SPECTER_MODELS=DIR, or pass model.weights=synthetic")
    if spec.is_tiny and not synthetic:
        raise SpecterError(f"{spec.name} is a tiny synthetic model; it has no checkpoint (use model.weights=synthetic)")
    if not synthetic:
        check_architecture(checkpoint_path(cfg), spec)
    device = None if cfg.device == "auto" else cfg.device
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise SpecterError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    checkpoint = None if synthetic or cfg.model.checkpoint is None else str(cfg.model.checkpoint)
    draft = None if cfg.model.get("draft") is None else str(cfg.model.draft)
    if layers is not None:
        with_layers(spec, layers)  # validates the depth before anything loads
    return ModelChoice(spec, synthetic, checkpoint, device, dtype, draft, cfg.model.weights, layers,
                       str(cfg.model.get("tokenizer") or "auto"))


def checkpoint_path(cfg) -> Path | None:
    """The checkpoint directory a run loads: model.checkpoint, else $SPECTER_MODELS/<name>; None for seeded weights."""
    if cfg.model.weights != "checkpoint":
        return None
    if cfg.model.checkpoint is not None:
        return Path(str(cfg.model.checkpoint))
    spec = get_spec(cfg.model.name)
    return None if spec.is_tiny else checkpoint_dir(spec)


def run_name(cfg) -> str:
    """The model part of a results directory's name: model.label (model=<checkpoint dir> sets it to the
    directory's name), else the model's name."""
    label = cfg.model.get("label")
    if label is None:
        return get_spec(cfg.model.name).name
    label = str(label)
    if label in ("", ".", "..") or "/" in label or os.sep in label:
        raise SpecterError(f"model.label names the results directory: it must be a plain name, got {label!r}")
    return label


def resident_slots(cfg, spec: ModelSpec) -> int:
    """Resident FP16 experts per MoE layer: mem.slots, else a GPU budget mem.gb, else the named preset."""
    if cfg.mem.slots is not None:
        return int(cfg.mem.slots)
    if cfg.mem.get("gb") is not None:
        dtype = DTYPES.get(cfg.dtype, torch.float16)
        return plan_memory(spec, hf_config(spec), dtype).slots_for(float(cfg.mem.gb))
    presets = cfg.model.get("mem_presets") or spec.mem_presets
    try:
        return int(presets[cfg.mem.preset])
    except KeyError:
        known = ", ".join(presets)
        raise SpecterError(f"{spec.name} has no memory preset {cfg.mem.preset!r}; known: {known}") from None


# SpecterConfig's fields that the harness derives; every other field is an option of the `specter` group
# (conf/specter/default.yaml), also set by a conf/system/specter_*.yaml ablation.
DERIVED = {"k": "the top-level k=", "resident_experts_per_layer": "mem= (mem.slots=N, mem=gb mem.gb=G)",
           "temperature": "the top-level temperature=", "seed": "the top-level seed="}


def specter_fields() -> tuple[str, ...]:
    """The options of the `specter` group: SpecterConfig's fields less the derived ones, in its order."""
    return tuple(field.name for field in dataclasses.fields(SpecterConfig) if field.name not in DERIVED)


def specter_options(options, where: str = "") -> dict:
    """Specter options (the `specter` group, or a system file's `specter:` block) as SpecterConfig keyword
    arguments; a derived or unknown key is a one-line error (`where`: what names the source in it)."""
    if options is None:
        return {}
    if isinstance(options, DictConfig):
        options = OmegaConf.to_container(options, resolve=True)
    if not isinstance(options, dict):
        raise SpecterError(f"{where}specter must be a mapping of Specter options, got {options!r}")
    for key in options:
        if key in DERIVED:
            raise SpecterError(f"{where}specter.{key} is not a Specter option here: it comes from {DERIVED[key]}")
        if key not in specter_fields():
            raise SpecterError(f"{where}unknown Specter option specter.{key}; known: {', '.join(specter_fields())}")
    return options


def specter_config(cfg, spec: ModelSpec, k: int | None = None) -> SpecterConfig:
    """The run's SpecterConfig: the `specter` group's options (cfg.specter) and the derived fields: k (the
    argument, else cfg.k: null = the model's depth-profiled K for the memory preset, else its default, auto = the best K found by experiment=depth for this
    model and memory setting), the resident experts per layer (mem), temperature and seed. SpecterConfig
    checks every value."""
    if k is None:
        default = spec.depth_k.get(cfg.mem.get("preset")) or int(cfg.model.get("default_k") or spec.default_k)
        k = default if cfg.k is None else (profiled_k(cfg, spec) if cfg.k == "auto" else cfg.k)
    return SpecterConfig(k=k, resident_experts_per_layer=resident_slots(cfg, spec), temperature=cfg.temperature,
                         seed=cfg.seed, **specter_options(cfg.specter))


def profiled_k(cfg, spec: ModelSpec) -> int:
    """The depth experiment's best K for this model and workload: this memory setting's profile, else
    the high one's. A profile measured on other weights (synthetic against calibrated) is refused."""
    depth, mismatch, name = Path(cfg.results_root) / "depth", [], run_name(cfg)
    for mem in (cfg.mem.name, "high"):
        path = depth / f"{name}-{mem}" / "best_k.json"
        if path.is_file():
            profile = json.loads(path.read_text())
            if profile.get("workload", workload(cfg)) == workload(cfg):
                return int(profile["best_k"])
            mismatch.append(f"{path} is for {profile['workload']}")
    found = f" ({'; '.join(mismatch)})" if mismatch else ""
    label, checkpoint = cfg.model.get("label"), cfg.model.checkpoint
    if checkpoint is not None and label is not None and Path(str(checkpoint)).resolve().name == label:
        source = f"model={checkpoint}"  # how model=<checkpoint dir> was given
    else:
        source = f"model={cfg.model.name}" + ("" if checkpoint is None else f" model.checkpoint={checkpoint}") \
            + ("" if label is None else f" model.label={label}")
    raise SpecterError(f"k=auto needs {depth / f'{name}-{cfg.mem.name}' / 'best_k.json'} for {workload(cfg)}"
                       f"{found}: run `python -m experiments.main experiment=depth {source} "
                       f"mem={cfg.mem.name} model.weights={cfg.model.weights}` first")


def check_run_settings(cfg) -> None:
    """One-line error for a nonsensical run-level value, before anything loads or any directory is made."""
    for name, least in (("num_prompts", 1), ("repeats", 1), ("max_new_tokens", 1), ("prefix_tokens", 1)):
        whole_number(cfg.get(name), name, least)
    if cfg.get("warmup_tokens") is not None:
        whole_number(cfg.warmup_tokens, "warmup_tokens", 0, " or null")
    if cfg.k is not None and cfg.k != "auto":
        whole_number(cfg.k, "k", 1, ", null or auto")
    known = {p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "system").glob("*.yaml")}
    for name, value in (cfg.get("token_caps") or {}).items():
        if name not in known:
            raise SpecterError(f"token_caps.{name}: unknown system {name!r}; known: {', '.join(sorted(known))}")
        if value is not None:
            whole_number(value, f"token_caps.{name}", 1, " or null")
    systems = cfg.get("systems")
    if not OmegaConf.is_list(systems) or len(systems) == 0:
        raise SpecterError(f"systems must be a non-empty list such as [specter,target_only], got {systems!r}")
    temperature = cfg.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise SpecterError(f"temperature must be a finite number >= 0, got {temperature!r}")
    whole_number(cfg.get("seed"), "seed", None)
    for name in ("k_values", "batch_sizes", "prefix_values"):
        values = cfg.experiment.get(name)
        if values is not None:
            if not OmegaConf.is_list(values) or len(values) == 0:
                raise SpecterError(f"experiment.{name} must be a non-empty list, got {values!r}")
            for value in values:
                whole_number(value, f"each of experiment.{name}", 1)
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise SpecterError(f"device={cfg.device} but this machine has no usable CUDA GPU; use device=cpu or device=auto")


def whole_number(value, name: str, least: int | None, alternatives: str = "") -> None:
    """Raise unless `value` is an int (not a bool, not 2.5, not a string) >= least."""
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        bound = "" if least is None else f" >= {least}"
        raise SpecterError(f"{name} must be an integer{bound}{alternatives}, got {value!r}")


def write_run_json(out_dir: Path, cfg, complete: bool, invocations: list[dict] | None = None,
                   machine: dict | None = None, h2d: dict | None = None, experts: dict | None = None) -> None:
    """run.json: resolved config, the checkpoint directory read (absolute; null for seeded weights), git
    commit, device, package versions, whether the run finished and, where given, `invocations`: one entry per
    process that wrote rows (see `invocation`). The top-level commit, GPU and machine are the latest one's
    (`machine`: the state this process measured once at its start; measured now where not given), and `h2d`,
    this process's pinned host-to-device link measurement (every trial, max, median, min; null without a GPU or
    before it is measured), whose maximum `h2d_gbps` is the rate of its rows' io_floor_ms; `experts`: where the
    FP experts were built (`expert_placement`)."""
    checkpoint = checkpoint_path(cfg)
    info = {
        "complete": complete,
        "workload": workload(cfg),
        "checkpoint": None if checkpoint is None else str(checkpoint.resolve()),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git_commit": provenance.commit(),
        "git_dirty": provenance.dirty(),  # None: not known (no own repository, or $SPECTER_COMMIT)
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine": machine if machine is not None else machine_state(cfg.device),
        "h2d_gbps": None if h2d is None else h2d["max_gbps"],
        "h2d": h2d,
        "experts": experts,
        "versions": {name: _version(name) for name in ("specter-moe", "torch", "transformers", "triton",
                                                       "hydra-core", "datasets")},
    }
    if invocations is not None:
        info["invocations"] = invocations
    (out_dir / "run.json").write_text(json.dumps(info, indent=2))


def invocation(cfg, first_row: int, machine: dict) -> dict:
    """What one process resuming (or starting) a results directory ran under: its start time (UTC), git
    commit, GPU and machine (`machine`: measured once at the process's start), and `first_row`, the 0-based index in records.csv of the first row it writes
    (rows are appended, so entry i wrote rows first_row[i] to first_row[i+1] - 1)."""
    return {"started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": provenance.commit(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "machine": machine, "first_row": first_row}


def earlier_invocations(out_dir: Path) -> list[dict]:
    """The invocations an existing run.json lists; one from its top-level commit, GPU and machine where it
    predates the list (first_row unknown: None); [] for a new directory or an unreadable run.json."""
    try:
        info = json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(info, dict):
        return []
    if isinstance(info.get("invocations"), list):
        return info["invocations"]
    if "git_commit" not in info and "machine" not in info:
        return []
    return [{"started_utc": None, "git_commit": info.get("git_commit"), "gpu": info.get("gpu"),
             "machine": info.get("machine"), "first_row": None}]


def workload(cfg) -> str:
    """Which weights a run's numbers come from, in words (also in run.json and the printed header)."""
    depth = "" if cfg.model.get("layers") is None else f", {cfg.model.layers} layers"
    kind = {"checkpoint": "checkpoint", "synthetic": "synthetic (seeded random) weights",
            "calibrated": "calibrated weights (real routing locality and acceptance)"}.get(cfg.model.weights,
                                                                                          cfg.model.weights)
    return f"{cfg.model.name}: {kind}{depth}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def header(model, config, cfg, what: str) -> str:
    """The line printed above a run's summary table."""
    depth = "" if cfg.model.get("layers") is None else f", {cfg.model.layers} layers"
    weights = f"{cfg.model.weights} weights{depth}"
    checkpoint = checkpoint_path(cfg)
    if checkpoint is not None:
        as_model = "" if model.spec.name == cfg.model.name else f" as model={cfg.model.name}"
        weights = f"checkpoint {checkpoint}{as_model}"
    return (f"{what}: {model.spec.name} ({weights}), K={config.k}, {config.resident_experts_per_layer} "
            f"resident experts/layer ({cfg.mem.name}), {cfg.num_prompts} prompts/dataset x {cfg.repeats} repeats x "
            f"{cfg.max_new_tokens} tokens on {model.device}")
