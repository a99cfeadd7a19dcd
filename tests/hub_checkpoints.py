"""Tiny checkpoints laid out exactly as the real Hugging Face Hub repositories of Specter's four models.

`write_hub_checkpoint(arch, directory)` writes, for arch in ARCHS:

- dsv2:    deepseek-ai/DeepSeek-V2-Lite
- qwen:    Qwen/Qwen1.5-MoE-A2.7B
- phi:     microsoft/Phi-3.5-MoE-instruct
- mixtral: mistralai/Mixtral-8x7B-v0.1

with the real repository's file set and formats at small sizes (hidden 128, expert intermediate 256, 8 experts
top-2, 2-3 layers, a ~500-token vocabulary):

- config.json as the Hub has it: the remote-code `auto_map` (DeepSeek-V2-Lite, Phi-3.5-MoE), `rope_scaling` in
  the old format (DeepSeek yarn, Phi longrope with the real long/short factors resampled to head_dim/2),
  `rope_theta`, `torch_dtype: bfloat16`, the real special-token ids mapped onto the tiny vocabulary, and the
  real values of every field that does not set a size;
- generation_config.json as the Hub has it (sampling defaults included, e.g. DeepSeek's do_sample);
- bfloat16 weights written with safetensors by hand (not by transformers' save_pretrained), in three shards
  named as the repository names them (DeepSeek-V2-Lite's `model-0000N-of-00000M` has six digits after "of")
  plus `model.safetensors.index.json`, with the Hub's per-expert tensor names
  (`mlp.experts.E.{gate,up,down}_proj.weight`, `block_sparse_moe.experts.E.w{1,2,3}.weight`);
- a real BPE tokenizer trained offline on CORPUS with `tokenizers`, in the family's own format: byte-level BPE
  (DeepSeek, Qwen: GPT-2 style, Qwen's split regex) or SentencePiece-style BPE with byte fallback and ▁
  (Mixtral, Phi: `<unk>`/`<s>`/`</s>` at ids 0-2, `<0x00>`..`<0xFF>` at 3-258), with the special tokens at
  the real positions (DeepSeek's and Qwen's after the regular vocabulary, Phi's `<|endoftext|>` and chat tokens
  after it too) and the real tokenizer_config.json class names.

The config files come from `tests/hub_configs.py` (real values and where they were found: REAL_VALUES), the
tokenizer files from `tests/hub_tokenizers.py`. Writing one checkpoint takes well under a second.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.hub_configs import ARCHS, INIT_STD, NUM_EXPERTS, NUM_SHARDS, generation_config, hub_config
from tests.hub_tokenizers import write_tokenizer

# --- weights ----------------------------------------------------------------------------------------------

def _attention_shapes(arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    if arch == "dsv2":
        rope, nope, v, rank = (config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"],
                               config["kv_lora_rank"])
        return {"q_proj.weight": (heads * (nope + rope), h), "kv_a_proj_with_mqa.weight": (rank + rope, h),
                "kv_a_layernorm.weight": (rank,), "kv_b_proj.weight": (heads * (nope + v), rank),
                "o_proj.weight": (h, heads * v)}
    head_dim, kv = h // heads, config["num_key_value_heads"]
    shapes = {"q_proj.weight": (heads * head_dim, h), "k_proj.weight": (kv * head_dim, h),
              "v_proj.weight": (kv * head_dim, h), "o_proj.weight": (h, heads * head_dim)}
    if arch == "qwen":  # QKV bias
        shapes.update({"q_proj.bias": (heads * head_dim,), "k_proj.bias": (kv * head_dim,),
                       "v_proj.bias": (kv * head_dim,)})
    if arch == "phi":  # attention_bias: all four projections
        shapes.update({"q_proj.bias": (heads * head_dim,), "k_proj.bias": (kv * head_dim,),
                       "v_proj.bias": (kv * head_dim,), "o_proj.bias": (h,)})
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inter, hidden), f"{prefix}.up_proj.weight": (inter, hidden),
            f"{prefix}.down_proj.weight": (hidden, inter)}


def hub_tensor_shapes(arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its Hub name, in the order the layers come."""
    h, vocab, e = config["hidden_size"], config["vocab_size"], NUM_EXPERTS
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for n in range(config["num_hidden_layers"]):
        layer = f"model.layers.{n}"
        shapes[f"{layer}.input_layernorm.weight"] = (h,)
        if arch == "phi":
            shapes[f"{layer}.input_layernorm.bias"] = (h,)
        shapes.update({f"{layer}.self_attn.{k}": s for k, s in _attention_shapes(arch, config).items()})
        shapes[f"{layer}.post_attention_layernorm.weight"] = (h,)
        if arch == "phi":
            shapes[f"{layer}.post_attention_layernorm.bias"] = (h,)
        if arch in ("phi", "mixtral"):
            moe = f"{layer}.block_sparse_moe"
            shapes[f"{moe}.gate.weight"] = (e, h)
            i = config["intermediate_size"]
            for x in range(e):
                shapes.update({f"{moe}.experts.{x}.w1.weight": (i, h), f"{moe}.experts.{x}.w2.weight": (h, i),
                               f"{moe}.experts.{x}.w3.weight": (i, h)})
        elif arch == "dsv2" and n < config["first_k_dense_replace"]:
            shapes.update(_mlp_shapes(f"{layer}.mlp", h, config["intermediate_size"]))
        else:
            i = config["moe_intermediate_size"]
            shapes[f"{layer}.mlp.gate.weight"] = (e, h)
            for x in range(e):
                shapes.update(_mlp_shapes(f"{layer}.mlp.experts.{x}", h, i))
            if arch == "dsv2":
                shapes.update(_mlp_shapes(f"{layer}.mlp.shared_experts", h, i * config["n_shared_experts"]))
            else:
                shapes.update(_mlp_shapes(f"{layer}.mlp.shared_expert", h, config["shared_expert_intermediate_size"]))
                shapes[f"{layer}.mlp.shared_expert_gate.weight"] = (1, h)
    shapes["model.norm.weight"] = (h,)
    if arch == "phi":
        shapes["model.norm.bias"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    if arch == "phi":
        shapes["lm_head.bias"] = (vocab,)
    return shapes


def random_weights(arch: str, config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded bfloat16 weights: norm scales 1, biases small, everything else N(0, INIT_STD[arch])."""
    generator = torch.Generator().manual_seed(seed * 1009 + ARCHS.index(arch))
    std = INIT_STD[arch]
    tensors = {}
    for name, shape in hub_tensor_shapes(arch, config).items():
        if "norm" in name and name.endswith(".weight"):
            value = torch.ones(shape)
        elif name.endswith(".bias"):
            value = 0.02 * torch.randn(shape, generator=generator)
        else:
            value = std * torch.randn(shape, generator=generator)
        tensors[name] = value.to(torch.bfloat16).contiguous()
    return tensors


def shard_name(arch: str, index: int, total: int) -> str:
    """Shard file name as the repository spells it (DeepSeek-V2-Lite: six digits after "of")."""
    of = f"{total:06d}" if arch == "dsv2" else f"{total:05d}"
    return f"model-{index:05d}-of-{of}.safetensors"


def write_weights(arch: str, directory: Path, tensors: dict[str, torch.Tensor], shards: int = NUM_SHARDS) -> dict:
    """Write `tensors` in `shards` files (consecutive, about equal bytes) plus the index; returns the index."""
    from safetensors.torch import save_file

    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = 0
    for name, size in zip(names, sizes):
        groups[min(shards - 1, running * shards // total)].append(name)
        running += size
    weight_map = {}
    for k, group in enumerate(groups, 1):
        file = shard_name(arch, k, shards)
        save_file({n: tensors[n] for n in group}, str(Path(directory) / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def write_hub_checkpoint(arch: str, directory: Path, seed: int = 0, *,
                         phi_mscales: tuple[float, float] | None = None,
                         original_max_position_embeddings: int | None = None) -> Path:
    """Write a tiny `arch` checkpoint into `directory` (created) laid out as the real Hub repository; returns it.

    phi_mscales: (short_mscale, long_mscale) instead of the real (equal) pair, so that the switch at
      original_max_position_embeddings changes the logits visibly (phi only).
    original_max_position_embeddings: shrink the rope scaling's original length (phi: also the top-level field;
      dsv2: the yarn block's), e.g. to 24, so that short prompts cross it.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if phi_mscales is not None and arch != "phi":
        raise ValueError("phi_mscales applies to phi only")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hub_config(arch, phi_mscales, original_max_position_embeddings)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(arch), indent=2) + "\n")
    write_tokenizer(arch, directory)
    write_weights(arch, directory, random_weights(arch, config, seed))
    return directory


def read_index(directory: Path) -> dict:
    return json.loads((Path(directory) / "model.safetensors.index.json").read_text())


def shard_files(directory: Path) -> list[str]:
    return sorted(set(read_index(directory)["weight_map"].values()))


# --- damage for the error tests ---------------------------------------------------------------------------

def drop_shard(directory: Path, which: int = -1) -> Path:
    """Delete one shard that the index lists (the last by default); returns its path."""
    path = Path(directory) / shard_files(directory)[which]
    path.unlink()
    return path


def truncate_shard(directory: Path, which: int = 0, keep: float = 0.5) -> Path:
    """Cut one shard the index lists to `keep` of its bytes (header intact, data short); returns its path."""
    path = Path(directory) / shard_files(directory)[which]
    data = path.read_bytes()
    path.write_bytes(data[: max(9, math.floor(len(data) * keep))])
    return path

