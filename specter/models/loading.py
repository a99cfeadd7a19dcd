"""Build a HybridMoEModel from a registered name (synthetic random weights) or a local HF checkpoint directory."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import transformers

from specter.errors import SpecterError
from specter.models.calibrated import calibrate, moe_layer_count, routing_profile, special_ids
from specter.models.host_experts import build_synthetic_on_host, hybridize_to_host
from specter.models.hybrid import HybridMoEModel, hybridize
from specter.models.memory_check import check_build_memory, experts_placement
from specter.models.registry import ARCHITECTURES, REGISTRY, ModelSpec, get_spec, spec_for_model_type
from specter.models.tokenizer import ByteTokenizer
from specter.quant.draft_io import load_draft
from specter.offload.residual_store import residual_dtype_problem

WEIGHTS = ("checkpoint", "synthetic", "calibrated")
DOWNLOAD_HINT = "run `python initialization/download_models.py --manifest initialization/model-assets.json --output DIR`"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


CHECKPOINT_DTYPE = torch.bfloat16  # what all four real checkpoints store; seeded builds on CUDA use it too
TOKENIZERS = ("auto", "byte")


def default_dtype(device: torch.device, stored: torch.dtype | None = None) -> torch.dtype:
    """float32 on the CPU; on CUDA the checkpoint's stored dtype (`stored`), else bfloat16, so seeded
    (synthetic and calibrated) and real runs compare."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return stored if stored in (torch.bfloat16, torch.float16, torch.float32) else CHECKPOINT_DTYPE


def stored_dtype(config: transformers.PretrainedConfig) -> torch.dtype | None:
    """The dtype a checkpoint's config.json records (`dtype`, formerly `torch_dtype`), if any."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


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


def checkpoint_architecture(path: Path) -> ModelSpec:
    """The registered full-size spec of a checkpoint directory's architecture (config.json's model_type);
    one-line errors for a missing directory, a missing or unreadable config.json, an unsupported type."""
    _validate_checkpoint(path)
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecterError(f"{path} is not an HF checkpoint directory (config.json is not a readable JSON "
                           f"object: {reason})") from None
    if not isinstance(model_type, str) or not model_type:
        raise SpecterError(f"{path} is not an HF checkpoint directory (config.json has no model_type)")
    try:
        return spec_for_model_type(model_type)
    except SpecterError:
        supported = ", ".join(f"{mt} (model={name})" for mt, name in sorted(ARCHITECTURES.items()))
        raise SpecterError(f"checkpoint {path} has model_type {model_type!r}, which Specter does not support; "
                           f"supported: {supported}") from None


def check_architecture(path: Path, spec: ModelSpec) -> None:
    """A checkpoint read as a registered model must be that architecture; the error names the right one."""
    found = checkpoint_architecture(path)
    if found.model_type != spec.model_type:
        raise SpecterError(f"checkpoint {path} is a {found.model_type} model (config.json), not the "
                           f"{spec.model_type} of {spec.name}: pass model={found.name} model.checkpoint={path}, "
                           f"or model={path} (library: load_model({str(path)!r}))")


def check_shards(path: Path) -> None:
    """One-line errors for an incomplete download: a shard the index lists but the directory lacks, a
    truncated or unreadable safetensors file (its header promises more bytes than the file holds)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise SpecterError(f"{index} is not a valid safetensors index ({exc}); download it again") from None
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    for shard in shards:
        if not (path / shard).is_file():
            raise SpecterError(f"checkpoint {path} is incomplete: {shard}, listed in {index.name}, is missing; "
                               f"{DOWNLOAD_HINT} (it resumes)")
        _check_safetensors_size(path / shard)


def _check_safetensors_size(file: Path) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len)) if 0 < header_len <= size - 8 else None
        end = max((t["data_offsets"][1] for k, t in (header or {}).items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, OSError):
        header = None
    if header is None or size < 8 + header_len + end:
        expected = f" of {8 + header_len + end}" if header is not None else ""
        raise SpecterError(f"checkpoint shard {file} is truncated or corrupt ({size}{expected} bytes); "
                           f"{DOWNLOAD_HINT} (it resumes)")


def checkpoint_tokenizer(path: Path, vocab_size: int, tokenizer: str = "auto"):
    """The checkpoint's own tokenizer; "byte" (asked for, or recorded by an export of a synthetic model in
    specter_tokenizer.json) gives byte-level ids. A checkpoint without a usable tokenizer is an error."""
    if tokenizer not in TOKENIZERS:
        raise SpecterError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    recorded = path / "specter_tokenizer.json"
    if tokenizer == "byte" or (recorded.is_file() and "ByteTokenizer" in recorded.read_text()):
        return ByteTokenizer(vocab_size)
    try:
        words = transformers.AutoTokenizer.from_pretrained(path)
        reason = None if len(words) > 1 and words("tokenizer probe")["input_ids"] else "it encodes text to nothing"
    except Exception as exc:  # noqa: BLE001 - any failure of AutoTokenizer means the same to the user
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    if reason is not None:  # e.g. Qwen2's tokenizer class builds an empty vocabulary when the files are absent
        raise SpecterError(f"no usable tokenizer in {path} ({reason}); download the tokenizer files, or ask for "
                           f"byte-level ids explicitly (load_model(..., tokenizer='byte'), harness "
                           f"model.tokenizer=byte)")
    return words


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype | None, tokenizer: str = "auto",
                    runs_on: torch.device | None = None):
    """(HF model, tokenizer, spec) from a local checkpoint directory, loaded onto `device` in `dtype`
    (None: default_dtype of the checkpoint's stored dtype on `runs_on`, the device it will run on)."""
    base = checkpoint_architecture(path)
    config = transformers.AutoConfig.from_pretrained(path)
    spec = dataclasses.replace(base, name=path.name, hf_config=config.to_dict())
    check_shards(path)
    words = checkpoint_tokenizer(path, config.vocab_size, tokenizer)
    dtype = dtype or default_dtype(runs_on or device, stored_dtype(config))
    check_build_memory(spec, config, device, dtype, experts_on_host=False)  # loaded whole onto `device` first
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    return model.eval(), words, spec


def checkpoint_spec(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    """(spec, HF config, dtype) of a checkpoint directory as loading it on `device` would have them (None dtype:
    what loading would pick), read from its config alone."""
    base = checkpoint_architecture(path)
    config = transformers.AutoConfig.from_pretrained(path)
    spec = dataclasses.replace(base, name=path.name, hf_config=config.to_dict())
    return spec, config, dtype or default_dtype(device, stored_dtype(config))


def checkpoint_placement(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple[bool, str]:
    """`experts_placement` of a checkpoint directory, from its config."""
    spec, config, dtype = checkpoint_spec(path, device, dtype)
    return experts_placement(spec, config, device, dtype)


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
    experts_on_host: bool | None = None,
    draft: str | os.PathLike | None = None,
    weights: str | None = None,
    num_layers: int | None = None,
    tokenizer: str = "auto",
    keep_raw_experts: bool = True,
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
      never holds them all; the engine then serves them through its expert cache. A checkpoint is read on the
      CPU first. None (the default): only where the whole build does not fit the GPU's free memory
      (`memory_check.experts_placement`: e.g. Phi-3.5-MoE and Mixtral on an 80 GB card).
    draft: a directory written by initialization/quantize_draft.py (GPTQ INT4 draft, checksummed);
      without it the draft is round-to-nearest INT4, quantized at load time.
    dtype: None = float32 on the CPU; on CUDA the checkpoint's stored dtype (bfloat16 for the four real
      checkpoints), and bfloat16 for synthetic builds. float16 only when passed.
    tokenizer: "auto" = the checkpoint's own (a checkpoint without a usable one is an error); "byte" =
      byte-level ids (what synthetic builds use).
    keep_raw_experts: False: experts built or loaded into the host store are encoded to residual blobs layer by
      layer as they come, against the RTN draft, and the host never holds them raw (16-bit experts, no `draft`
      directory; elsewhere they are kept raw): only Specter with residual transfer serves such a model.
    """
    synthetic, calibrated = weights_choice(synthetic, weights)
    keep_raw = keep_raw_experts or draft is not None  # blobs are encoded against the draft the model keeps
    model = _load(name_or_path, synthetic, device, dtype, seed, experts_on_host, calibrated, num_layers, tokenizer,
                  keep_raw)
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
          num_layers: int | None = None, tokenizer: str = "auto", keep_raw: bool = True) -> HybridMoEModel:
    device = torch.device(device) if device is not None else default_device()
    name = str(name_or_path)
    if name in REGISTRY or (synthetic and not Path(name).exists()):
        spec = with_layers(get_spec(name), num_layers)
        if synthetic is None:
            synthetic = spec.is_tiny
        if num_layers is not None and not synthetic:
            raise SpecterError("num_layers rebuilds a registered architecture: it needs synthetic or calibrated weights")
        if synthetic:
            words, dtype = ByteTokenizer(spec.hf_config["vocab_size"]), dtype or default_dtype(device)
            if calibrated:
                routing_profile(spec)  # fail before building
            if experts_on_host is None:
                experts_on_host = experts_placement(spec, hf_config(spec), device, dtype)[0]
            encoded = experts_on_host and not keep_raw and not residual_dtype_problem(dtype)
            check_build_memory(spec, hf_config(spec), device, dtype, experts_on_host, encoded=encoded)
            if experts_on_host:
                return build_synthetic_on_host(spec, hf_config(spec), words, device, dtype, seed, calibrated, keep_raw)
            return hybridize(build_synthetic(spec, device, dtype, seed, calibrated), spec, words)
        path = checkpoint_dir(spec)
        if not path.exists():
            raise SpecterError(
                f"no checkpoint for {spec.name!r} at {path}: {DOWNLOAD_HINT} --only {spec.name} "
                f"(or set SPECTER_MODELS), or use synthetic weights")
        check_architecture(path, spec)
    else:
        if num_layers is not None:
            raise SpecterError("num_layers rebuilds a registered architecture: a checkpoint keeps its own depth")
        path = Path(name)
        if not path.exists() and os.sep not in name and "/" not in name:
            get_spec(name)  # neither a known name nor a path: raises "unknown model"
    if experts_on_host is None:
        experts_on_host = checkpoint_placement(path, device, dtype)[0]
    if experts_on_host:
        model, words, spec = load_checkpoint(path, torch.device("cpu"), dtype, tokenizer, runs_on=device)
        return hybridize_to_host(model, spec, words, device, keep_raw)
    model, words, spec = load_checkpoint(path, device, dtype, tokenizer)
    return hybridize(model, spec, words)
