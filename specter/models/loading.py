"""Build a HybridMoEModel from a registered name (synthetic random weights) or a local HF checkpoint directory."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import transformers

from specter.errors import SpecterError
from specter.models.calibrated import calibrate, moe_layer_count, routing_profile, special_ids
from specter.models.host_experts import build_synthetic_on_host, hybridize_to_host
from specter.models.hybrid import HybridMoEModel, hybridize
from specter.models.registry import REGISTRY, ModelSpec, get_spec, spec_for_model_type
from specter.models.tokenizer import ByteTokenizer
from specter.quant.draft_io import load_draft

WEIGHTS = ("checkpoint", "synthetic", "calibrated")
DOWNLOAD_HINT = "run `python initialization/download_models.py --manifest initialization/model-assets.json --output DIR`"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def hf_config(spec: ModelSpec) -> transformers.PretrainedConfig:
    """The HF config object of a registered model (seeded synthetic builds use it as is)."""
    config = transformers.AutoConfig.for_model(spec.model_type, **spec.hf_config)
    config.num_experts_per_tok = spec.hf_config["num_experts_per_tok"]  # None by default in DeepseekV2Config
    return config


def build_synthetic(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int,
                    calibrated: bool = False) -> torch.nn.Module:
    """The registered architecture with seeded random weights, created directly on `device`
    (calibrated: rewritten into the layout of specter/models/calibrated.py)."""
    torch.manual_seed(seed)
    config = hf_config(spec)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if calibrated:
        calibrate(model, routing_profile(spec), special_ids(config), moe_layer_count(config), seed)
    return model.eval()


def with_layers(spec: ModelSpec, num_layers: int | None) -> ModelSpec:
    """The spec at another depth (full width, `num_layers` decoder layers), for CPU-sized experiments."""
    if num_layers is None:
        return spec
    dense = int(spec.hf_config.get("first_k_dense_replace", 0) or 0)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= dense:
        raise SpecterError(f"model layers must be an integer above {dense} for {spec.name} (its dense layers), "
                           f"got {num_layers!r}")
    return dataclasses.replace(spec, hf_config={**spec.hf_config, "num_hidden_layers": num_layers})


def checkpoint_dir(spec: ModelSpec) -> Path:
    """Where download_models.py puts a registered model: $SPECTER_MODELS/<name> (default ./checkpoints/<name>)."""
    return Path(os.environ.get("SPECTER_MODELS", "checkpoints")) / spec.name


def _validate_checkpoint(path: Path) -> None:
    if not path.exists():
        raise SpecterError(f"checkpoint path {path} does not exist; {DOWNLOAD_HINT}, or use synthetic weights")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise SpecterError(f"{path} is not an HF checkpoint directory (no config.json); {DOWNLOAD_HINT}")


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype):
    """(HF model, tokenizer, spec) from a local checkpoint directory, loaded onto `device`."""
    _validate_checkpoint(path)
    config = transformers.AutoConfig.from_pretrained(path)
    base = spec_for_model_type(config.model_type)
    spec = dataclasses.replace(base, name=path.name, hf_config=config.to_dict())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = ByteTokenizer(config.vocab_size)
    return model.eval(), tokenizer, spec


def check_model_source(name_or_path: str | os.PathLike) -> None:
    """Raise the one-line error load_model would give for an unknown name or a bad checkpoint path, cheaply."""
    name = str(name_or_path)
    if name in REGISTRY:
        return
    if Path(name).exists() or os.sep in name or "/" in name:
        _validate_checkpoint(Path(name))
    else:
        get_spec(name)


def load_model(
    name_or_path: str | os.PathLike,
    synthetic: bool | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    experts_on_host: bool = False,
    draft: str | os.PathLike | None = None,
    weights: str | None = None,
    num_layers: int | None = None,
) -> HybridMoEModel:
    """A shared-instance hybrid model.

    name_or_path: a registered name (tiny, tiny-qwen, dsv2, ...) or a checkpoint directory.
    synthetic: build seeded random weights from the registered config. None means: yes for the tiny
      models (they have no checkpoint), no for full-size models (their checkpoint is loaded).
    weights: "checkpoint", "synthetic" (= synthetic=True) or "calibrated": seeded weights laid out so that
      routing locality, draft acceptance and logit margins follow the real checkpoint's (the spec's
      RoutingProfile; specter/models/calibrated.py). None: as `synthetic` says.
    num_layers: build a registered architecture with this many decoder layers (synthetic and calibrated
      weights only), e.g. a full-width 4-layer dsv2 that fits a CPU.
    experts_on_host: put the FP routed experts straight into the (pinned) host store, so the device
      never holds them all (required when they do not fit, e.g. Phi-3.5-MoE on a 40 GB card); the
      engine then serves them through its expert cache. A checkpoint is read on the CPU first.
    draft: a directory written by initialization/quantize_draft.py (GPTQ INT4 draft, checksummed);
      without it the draft is round-to-nearest INT4, quantized at load time.
    """
    synthetic, calibrated = weights_choice(synthetic, weights)
    model = _load(name_or_path, synthetic, device, dtype, seed, experts_on_host, calibrated, num_layers)
    if draft is not None:
        load_draft(model, draft)
    return model


def weights_choice(synthetic: bool | None, weights: str | None) -> tuple[bool | None, bool]:
    """(synthetic, calibrated) from load_model's two ways of saying it; a contradiction is an error."""
    if weights is None:
        return synthetic, False
    if weights not in WEIGHTS:
        raise SpecterError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if synthetic is not None and synthetic != (weights != "checkpoint"):
        raise SpecterError(f"synthetic={synthetic} contradicts weights={weights!r}")
    return weights != "checkpoint", weights == "calibrated"


def _load(name_or_path, synthetic, device, dtype, seed: int, experts_on_host: bool, calibrated: bool = False,
          num_layers: int | None = None) -> HybridMoEModel:
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    name = str(name_or_path)
    if name in REGISTRY or (synthetic and not Path(name).exists()):
        spec = with_layers(get_spec(name), num_layers)
        if synthetic is None:
            synthetic = spec.is_tiny
        if num_layers is not None and not synthetic:
            raise SpecterError("num_layers rebuilds a registered architecture: it needs synthetic or calibrated weights")
        if synthetic:
            tokenizer = ByteTokenizer(spec.hf_config["vocab_size"])
            if calibrated:
                routing_profile(spec)  # fail before building
            if experts_on_host:
                return build_synthetic_on_host(spec, hf_config(spec), tokenizer, device, dtype, seed, calibrated)
            return hybridize(build_synthetic(spec, device, dtype, seed, calibrated), spec, tokenizer)
        path = checkpoint_dir(spec)
        if not path.exists():
            raise SpecterError(
                f"no checkpoint for {spec.name!r} at {path}: {DOWNLOAD_HINT} --only {spec.name} "
                f"(or set SPECTER_MODELS), or use synthetic weights")
    else:
        if num_layers is not None:
            raise SpecterError("num_layers rebuilds a registered architecture: a checkpoint keeps its own depth")
        path = Path(name)
        if not path.exists() and os.sep not in name and "/" not in name:
            get_spec(name)  # neither a known name nor a path: raises "unknown model"
    if experts_on_host:
        model, tokenizer, spec = load_checkpoint(path, torch.device("cpu"), dtype)
        return hybridize_to_host(model, spec, tokenizer, device)
    model, tokenizer, spec = load_checkpoint(path, device, dtype)
    return hybridize(model, spec, tokenizer)
