"""How much the target itself writes along the acceptance direction g, against the draft's designed signal there.

A calibrated build's draft differs from its target only along g (specter/models/calibrated.py): the target
writes nothing there in exact arithmetic, the INT4 draft's quantization error does. 16-bit rounding puts noise
on g in the target too, which the LM head's gain turns into logit noise: where it is not small against the
draft's signal, the target leaves its designed walk and acceptance falls. Per model, depth and dtype this
prints, over the final norm's outputs of a forward over local text (1 prompt per dataset, `--tokens` tokens):
the target's RMS along g (noise), the draft's RMS difference from it along g (signal) and their ratio.

    python scripts/acceptance_noise.py --models qwen dsv2 --layers 2 4 8 --dtypes bfloat16 float16 --out noise.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.datasets import DATASETS, local_datasets, prompts_for  # noqa: E402
from experiments.provenance import commit  # noqa: E402
from specter.models.calibrated import acceptance_direction  # noqa: E402
from specter.models.loading import load_model  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def text_ids(tokenizer, tokens: int) -> list[torch.Tensor]:
    """One [1, tokens] id sequence per local dataset (its first prompt, cut)."""
    out = []
    for name in (d for d in DATASETS if d in local_datasets()):
        cfg = OmegaConf.create({"name": name, "members": [name], "path": None, "source": "local"})
        ids = tokenizer(" ".join(prompts_for(cfg, 4)[name]))["input_ids"][:tokens]
        out.append(torch.tensor([ids]))
    return out


@torch.inference_mode()
def g_projections(model, ids: torch.Tensor, g: torch.Tensor, mode: str) -> torch.Tensor:
    """[T] the final norm's output along g in a forward of `mode` ("target" or "draft")."""
    final = {}
    handle = model.hf.model.norm.register_forward_hook(lambda m, a, out: final.__setitem__("x", out[0]))
    try:
        model.forward(ids, DynamicCache(config=model.hf.config), mode=mode)
    finally:
        handle.remove()
    return final["x"].float().cpu() @ g


def measure(name: str, layers: int, dtype: str, tokens: int, seed: int) -> dict:
    model = load_model(name, weights="calibrated", num_layers=layers, dtype=DTYPES[dtype], device="cpu", seed=seed)
    g = acceptance_direction(model.hf.config.hidden_size, seed)
    noise, signal = [], []
    for ids in text_ids(model.tokenizer, tokens):
        target = g_projections(model, ids, g, "target")
        draft = g_projections(model, ids, g, "draft")
        noise.append(target)
        signal.append(draft - target)
    noise_rms, signal_rms = (float(torch.cat(x).pow(2).mean().sqrt()) for x in (noise, signal))
    return {"model": name, "layers": layers, "dtype": dtype, "target_g_rms": noise_rms, "draft_g_rms": signal_rms,
            "noise_over_signal": noise_rms / signal_rms if signal_rms else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen"])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append the rows to this CSV")
    args = parser.parse_args()
    if not local_datasets():
        sys.exit("error: no local dataset file (set SPECTER_DATA)")
    fields = ["commit", "model", "layers", "dtype", "target_g_rms", "draft_g_rms", "noise_over_signal"]
    writer = None
    if args.out:
        new = not args.out.exists()
        handle = args.out.open("a", newline="")
        writer = csv.DictWriter(handle, fields)
        if new:
            writer.writeheader()
    print(" | ".join(fields))
    for name in args.models:
        for layers in args.layers:
            for dtype in args.dtypes:
                row = {"commit": commit(short=True) or "unknown", **measure(name, layers, dtype, args.tokens, args.seed)}
                print(" | ".join(f"{row[f]:.4g}" if isinstance(row[f], float) else str(row[f]) for f in fields),
                      flush=True)
                if writer:
                    writer.writerow(row)
                    handle.flush()


if __name__ == "__main__":
    main()
