"""Save and load a model's INT4 draft experts: `draft.safetensors` plus a `draft.json` manifest with a checksum.

Directory layout:

- `draft.safetensors`: per MoE layer l, `experts.{l}.gate_up.qweight` [E, H/8, 2I] int32,
  `experts.{l}.gate_up.scales` [E, H/g, 2I], `experts.{l}.down.qweight` [E, I/8, H] int32,
  `experts.{l}.down.scales` [E, I/g, H] (the packed layout of int4.py).
- `draft.json`: format/version, quantizer ("gptq" or "rtn"), group size, model name and architecture,
  number of MoE layers and experts, hidden and expert intermediate sizes, every tensor's shape and
  dtype, a small fingerprint of the target weights the draft was quantized from, the SHA-256 of
  `draft.safetensors`, and any extra information the caller passes (e.g. the calibration report).

`load_draft` checks everything before touching the model (files present, JSON readable, checksum,
architecture, layer/expert counts, shapes against the model, target fingerprint), raising a one-line
`SpecterError` on the first problem; only then does it install the weights with `set_draft_weights`
and set `model.quantizer`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from specter.errors import SpecterError
from specter.quant.gptq import target_layer_weights
from specter.quant.int4 import PACK, Int4Linear

WEIGHTS_FILE = "draft.safetensors"
MANIFEST_FILE = "draft.json"
FORMAT = "specter-draft"
VERSION = 1
PARTS = ("gate_up", "down")
FINGERPRINT_VALUES = 8  # first values of expert 0, row 0 of each layer's gate_up target weight
FINGERPRINT_RTOL = 1e-2  # loose enough for a float32 draft loaded into an fp16/bf16 model


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _expected_shapes(model, group_size: int) -> dict[str, list[int]]:
    """The tensor shapes a draft for `model` must have: gate_up is [2I, H] per expert, down [H, I]."""
    shapes = {}
    for l, module in enumerate(model.experts):
        e, h, i = module.num_experts, module.hidden_dim, module.intermediate_dim
        for part, (out_features, in_features) in zip(PARTS, ((2 * i, h), (h, i))):
            shapes[f"experts.{l}.{part}.qweight"] = [e, in_features // PACK, out_features]
            shapes[f"experts.{l}.{part}.scales"] = [e, in_features // group_size, out_features]
    return shapes


def _fingerprint(model) -> list[list[float]]:
    """The first few target gate_up values of expert 0 per layer (on the module or in the host store)."""
    return [target_layer_weights(model, module)[0][0, 0, :FINGERPRINT_VALUES].float().cpu().tolist()
            for module in model.experts]


def _model_info(model) -> dict:
    first = model.experts[0]
    return {"model": model.spec.name, "model_type": model.spec.model_type, "num_layers": len(model.experts),
            "num_experts": first.num_experts, "hidden_size": first.hidden_dim,
            "intermediate_size": first.intermediate_dim}


def _dumps(obj) -> str:
    """Indented JSON with flat lists (shapes, fingerprints) kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)


def save_draft(model, directory: str | os.PathLike, extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write the model's current draft experts to `directory` (created if needed); returns the directory.

    Refuses to replace an existing draft unless `overwrite`. The manifest is written last, so a directory
    with `draft.json` always has a complete `draft.safetensors`.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise SpecterError(f"{directory} exists and is not a directory")
    existing = [n for n in (WEIGHTS_FILE, MANIFEST_FILE) if (directory / n).exists()]
    if existing and not overwrite:
        raise SpecterError(f"{directory} already holds a draft ({', '.join(existing)}); choose a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    group_size = model.experts[0].group_size
    for l, module in enumerate(model.experts):
        if module.group_size != group_size:
            raise SpecterError(f"MoE layer {l} has group size {module.group_size}, layer 0 has {group_size}")
        for part, packed in zip(PARTS, (module.draft_gate_up, module.draft_down)):
            tensors[f"experts.{l}.{part}.qweight"] = packed.qweight.detach().cpu().contiguous()
            tensors[f"experts.{l}.{part}.scales"] = packed.scales.detach().cpu().contiguous()
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    weights_path = directory / WEIGHTS_FILE
    save_file(tensors, str(weights_path), metadata={"format": FORMAT, "quantizer": model.quantizer})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "quantizer": model.quantizer,
        "group_size": group_size,
        **_model_info(model),
        "shapes": {k: list(t.shape) for k, t in tensors.items()},
        "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
        "target_fingerprint": _fingerprint(model),
        "file": WEIGHTS_FILE,
        "sha256": sha256_file(weights_path),
    }
    if extra:
        manifest["extra"] = extra
    (directory / MANIFEST_FILE).write_text(_dumps(manifest) + "\n")
    return directory


def read_manifest(directory: str | os.PathLike) -> dict:
    """The parsed `draft.json` of a draft directory (one-line SpecterError if missing or unreadable)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecterError(f"draft directory {directory} does not exist; run initialization/quantize_draft.py")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise SpecterError(f"{path} is missing; {directory} is not a complete draft (re-run quantize_draft.py)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecterError(f"{path} is not readable JSON ({type(exc).__name__}); re-run quantize_draft.py") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecterError(f"{path} is not a Specter draft manifest (format != {FORMAT!r})")
    missing = [k for k in ("version", "quantizer", "group_size", "model_type", "num_layers", "num_experts",
                           "shapes", "sha256") if k not in manifest]
    if missing:
        raise SpecterError(f"{path} lacks {', '.join(missing)}; re-run quantize_draft.py")
    group_size = manifest["group_size"]
    if (not isinstance(group_size, int) or group_size <= 0 or group_size % PACK
            or not isinstance(manifest["shapes"], dict)):
        raise SpecterError(f"{path} has an invalid group_size or shapes; re-run quantize_draft.py")
    if manifest["version"] != VERSION:
        raise SpecterError(f"{path} has draft format version {manifest['version']}, this Specter reads {VERSION}")
    return manifest


def _check_compatible(model, manifest: dict, where: Path) -> None:
    info = _model_info(model)
    if manifest["model_type"] != info["model_type"]:
        raise SpecterError(f"draft {where} is for a {manifest['model_type']} model ({manifest.get('model')}), "
                           f"not {info['model_type']} ({info['model']})")
    for key in ("num_layers", "num_experts", "hidden_size", "intermediate_size"):
        if key in manifest and manifest[key] != info[key]:
            raise SpecterError(f"draft {where} has {key}={manifest[key]}, the model {info['model']} has {info[key]}")
    expected = _expected_shapes(model, int(manifest["group_size"]))
    if set(manifest["shapes"]) != set(expected):
        raise SpecterError(f"draft {where} lists {len(manifest['shapes'])} tensors, not the model's {len(expected)} "
                           f"experts.<layer>.gate_up|down.qweight|scales")
    for key, shape in expected.items():
        if list(manifest["shapes"][key]) != shape:
            raise SpecterError(f"draft {where}: {key} has shape {manifest['shapes'][key]}, the model needs {shape}")
    stored = manifest.get("target_fingerprint")
    if stored is not None:
        for l, (old, new) in enumerate(zip(stored, _fingerprint(model))):
            old_t, new_t = torch.tensor(old), torch.tensor(new)
            if old_t.shape != new_t.shape or not torch.allclose(old_t, new_t, rtol=FINGERPRINT_RTOL, atol=1e-3):
                raise SpecterError(f"draft {where} was quantized from different target weights than {info['model']} "
                                   f"(MoE layer {l} fingerprint differs); re-quantize for this checkpoint")


def load_draft(model, directory: str | os.PathLike) -> dict:
    """Verify and install the draft in `directory` into `model`; returns the manifest.

    Raises SpecterError (one line) for a missing directory/file, unreadable manifest, checksum mismatch
    (corrupt or modified safetensors), an architecture/shape mismatch or a fingerprint mismatch.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    manifest = read_manifest(directory)
    name = str(manifest.get("file", WEIGHTS_FILE))
    if Path(name).name != name:
        raise SpecterError(f"{directory / MANIFEST_FILE}: file {name!r} must be a plain name inside the directory")
    weights_path = directory / name
    if not weights_path.is_file():
        raise SpecterError(f"{weights_path} is missing; re-run quantize_draft.py")
    digest = sha256_file(weights_path)
    if digest != manifest["sha256"]:
        raise SpecterError(f"{weights_path} is corrupt or modified: SHA-256 {digest[:12]}... does not match "
                           f"draft.json ({str(manifest['sha256'])[:12]}...); re-run quantize_draft.py")
    _check_compatible(model, manifest, directory)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecterError(f"{weights_path} cannot be read as safetensors: {str(exc).splitlines()[0]}") from None
    for key, shape in manifest["shapes"].items():
        if key not in tensors or list(tensors[key].shape) != list(shape):
            raise SpecterError(f"{weights_path}: tensor {key} is missing or has another shape than draft.json says")
        if key.endswith(".qweight") and tensors[key].dtype != torch.int32:
            raise SpecterError(f"{weights_path}: {key} is {tensors[key].dtype}, expected int32")
    group_size = int(manifest["group_size"])
    for l, module in enumerate(model.experts):
        dtype = module.draft_gate_up_scales.dtype  # the model's dtype (a float32 draft may go into fp16)
        packed = [Int4Linear(tensors[f"experts.{l}.{part}.qweight"], tensors[f"experts.{l}.{part}.scales"].to(dtype),
                             group_size) for part in PARTS]
        module.set_draft_weights(*packed)
    model.quantizer = str(manifest["quantizer"])
    return manifest


__all__ = ["MANIFEST_FILE", "WEIGHTS_FILE", "load_draft", "read_manifest", "save_draft", "sha256_file"]
