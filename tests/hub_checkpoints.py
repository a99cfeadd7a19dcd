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

Real values and where they were found are in REAL_VALUES. Writing one checkpoint takes well under a second.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from specter.models.registry import PHI_LONG_FACTOR, PHI_MSCALE, PHI_SHORT_FACTOR, resample

ARCHS = ("dsv2", "qwen", "phi", "mixtral")
REPOS = {
    "dsv2": "deepseek-ai/DeepSeek-V2-Lite",
    "qwen": "Qwen/Qwen1.5-MoE-A2.7B",
    "phi": "microsoft/Phi-3.5-MoE-instruct",
    "mixtral": "mistralai/Mixtral-8x7B-v0.1",
}
MODEL_TYPES = {"dsv2": "deepseek_v2", "qwen": "qwen2_moe", "phi": "phimoe", "mixtral": "mixtral"}

HIDDEN = 128
EXPERT_INTERMEDIATE = 256
NUM_EXPERTS = 8
TOP_K = 2
NUM_SHARDS = 3
# init std of the random weights: large enough that the routed experts (and so the INT4 draft's error) move
# the logits, so greedy text does not collapse into one token and the draft is rejected now and then
INIT_STD = {"dsv2": 0.1, "qwen": 0.1, "phi": 0.1, "mixtral": 0.1}

# --- real values ------------------------------------------------------------------------------------------

# The Phi-3.5-MoE factor lists (and their sources) are the registry's: specter.models.registry.
PHI_ORIGINAL_MAX_POSITIONS = 4096

# deepseek-ai/DeepSeek-V2-Lite config.json (q_lora_rank null, rope_theta 10000): the yarn block below
DSV2_ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"}

REAL_VALUES = {
    "dsv2": {"rope_theta": 10000, "rope_scaling": DSV2_ROPE_SCALING, "max_position_embeddings": 163840,
             "source": "REFERENCE/ROPE_SCALING of a DeepSeek-V2-Lite analyzer pinned to "
                       "slowfastai/DeepSeek-V2-Lite-bnb-4bit@9fc3573 (a re-upload of the Lite config), and a dump "
                       "of DeepSeek-V2-Lite-Chat's DeepseekV2Config (auto_map, ids, sizes)"},
    "qwen": {"rope_theta": 1000000.0, "max_position_embeddings": 8192, "sliding_window": 32768,
             "use_sliding_window": False, "max_window_layers": 21,
             "source": "Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 config (rope_theta, sliding_window, max_window_layers; "
                       "its max_position_embeddings is the chat model's 32768) and the Qwen2MoeConfig defaults "
                       "ported with the architecture (8192, 1e6, 32768); Specter's registry also says 8192"},
    "phi": {"rope_theta": 10000.0, "long_factor": PHI_LONG_FACTOR, "short_factor": PHI_SHORT_FACTOR,
            "long_mscale": PHI_MSCALE, "short_mscale": PHI_MSCALE, "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072, "sliding_window": 131072,
            "source": "Ascend/MindSpeed-LLM examples/mcore/phi35/pretrain_phi35_moe_ptd.sh (factor lists), a "
                      "Phi-3.5-MoE-instruct model-card digest listing every config.json field (auto_map, jitter, "
                      "sliding_window 131072, ids 1/32000)"},
    "mixtral": {"rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
                "source": "MIXTRAL_8X7B_CONFIG in NVIDIA TensorRT-LLM's tests and a blog quoting "
                          "huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (identical)"},
}

CORPUS = """\
The old lighthouse stood at the end of a long stone pier, and every evening the keeper climbed the narrow stairs to
light the lamp. From the top he could see the whole harbour: the fishing boats coming home, the gulls circling over
the nets, and the small houses of the town climbing up the hill behind the market. He had kept the light for thirty
years, and in all that time the ships had never once missed the entrance to the bay.

Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did
Natalia sell altogether in April and May? She counted them twice, wrote the numbers in her notebook, and found that
the answer was 72. Her brother said that the method mattered more than the answer, so she explained every step.

A train leaves the station at nine in the morning and travels north at sixty miles an hour. Another train leaves
two hours later on the same line and travels at ninety miles an hour. The question is when the second train will
catch up with the first, and how far from the station the two trains will be when it does.

In the garden there were apples, pears and plums, and the children picked the fruit in baskets while their
grandmother made jam in the kitchen. The jars were lined up on the window, red and gold in the afternoon light, and
the whole house smelled of sugar and warm fruit until the evening came and the lamps were lit.

def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)

The weather report said that the wind would turn to the west during the night, bringing rain and cooler air to the
coast. Farmers in the valley hoped the rain would come early, because the fields were dry and the river was low.
"""

# --- tokenizers -------------------------------------------------------------------------------------------

QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2Tokenizer's PRETOKENIZE_REGEX
DSV2_BOS, DSV2_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# (regular vocabulary size trained on CORPUS, special tokens appended after it, total padded to in config.json)
TOKENIZER_LAYOUT = {
    # DeepSeek-V2-Lite: 100000 regular tokens, then bos 100000, eos 100001, fim/chat tokens; config vocab 102400
    "dsv2": (480, [DSV2_BOS, DSV2_EOS, "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<|EOT|>"],
             512),
    # Qwen1.5: 151643 regular tokens, then <|endoftext|> (bos = eos = pad), <|im_start|>, <|im_end|>; config 151936
    "qwen": (480, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 512),
    # Phi-3.5-MoE: <unk> <s> </s>, bytes, 32000 regular tokens total, then <|endoftext|> (eos) 32000 and the chat
    # tokens 32001-32010; config vocab 32064
    "phi": (480, ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                  "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"],
            512),
    # Mixtral: <unk> <s> </s>, bytes, 32000 tokens in all; config vocab 32000 (no padding)
    "mixtral": (512, [], 512),
}
LLAMA_STYLE = ("phi", "mixtral")


def _trained_merges(tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(arch: str) -> str:
    """The arch's tokenizer.json (a string), trained on CORPUS; deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    regular, specials, _ = TOKENIZER_LAYOUT[arch]
    if arch in LLAMA_STYLE:
        # SentencePiece-style BPE as the Llama-family tokenizer.json has it: <unk> <s> </s>, <0x00>..<0xFF>
        # (byte fallback), then pieces with ▁ for spaces; normalizer Prepend(▁) + Replace(" ", ▁), no
        # pre-tokenizer
        trainer_tok = Tokenizer(models.BPE())
        trainer_tok.normalizer = normalizers.Replace(" ", "▁")
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        trainer_tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=regular - 259, show_progress=False))
        pieces = sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
        for piece, _ in pieces:
            vocab.setdefault(piece, len(vocab))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_trained_merges(trainer_tok), unk_token="<unk>",
                                   fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])
        if arch == "mixtral":  # add_bos_token true
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    else:
        tok = Tokenizer(models.BPE())
        if arch == "qwen":
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=regular, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator([CORPUS], trainer)
        if arch == "qwen":
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == regular, (arch, tok.get_vocab_size())
    if specials:
        tok.add_special_tokens(specials)
    if arch == "dsv2":  # LlamaTokenizerFast with add_bos_token true: bos in the post-processor
        bos = tok.token_to_id(DSV2_BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{DSV2_BOS} $A", pair=f"{DSV2_BOS} $A {DSV2_BOS} $B", special_tokens=[(DSV2_BOS, bos)])
    return tok.to_str(pretty=True)


def special_ids(arch: str) -> dict[str, int | None]:
    """bos / eos / pad ids of the tiny checkpoint (at the real positions relative to the vocabulary)."""
    regular, _, _ = TOKENIZER_LAYOUT[arch]
    if arch == "dsv2":
        return {"bos": regular, "eos": regular + 1, "pad": regular + 1}
    if arch == "qwen":
        return {"bos": regular, "eos": regular, "pad": regular}
    if arch == "phi":
        return {"bos": 1, "eos": regular, "pad": regular}
    return {"bos": 1, "eos": 2, "pad": None}


def _added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def _tokenizer_config(arch: str) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) with the real repository's fields."""
    regular, specials, _ = TOKENIZER_LAYOUT[arch]
    decoder = {}
    if arch in LLAMA_STYLE:
        decoder.update({str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
                        for i, c in enumerate(("<unk>", "<s>", "</s>"))})
    for i, c in enumerate(specials):
        decoder[str(regular + i)] = {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
    if arch == "dsv2":
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": _added_token(DSV2_BOS),
                  "clean_up_tokenization_spaces": False, "eos_token": _added_token(DSV2_EOS), "legacy": True,
                  "model_max_length": 16384, "pad_token": _added_token(DSV2_EOS), "sp_model_kwargs": {},
                  "unk_token": None, "tokenizer_class": "LlamaTokenizerFast", "added_tokens_decoder": decoder}
        special_map = {"bos_token": DSV2_BOS, "eos_token": DSV2_EOS, "pad_token": DSV2_EOS}
    elif arch == "qwen":
        config = {"add_prefix_space": False, "added_tokens_decoder": decoder,
                  "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
                  "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
                  "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
        special_map = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|endoftext|>",
                       "pad_token": "<|endoftext|>"}
    elif arch == "phi":
        config = {"add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": decoder,
                  "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
                  "legacy": False, "model_max_length": 131072, "pad_token": "<|endoftext|>", "padding_side": "left",
                  "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
                  "use_default_system_prompt": False}
        special_map = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                       "unk_token": "<unk>"}
    else:
        config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
                  "additional_special_tokens": [], "bos_token": "<s>", "clean_up_tokenization_spaces": False,
                  "eos_token": "</s>", "legacy": True, "model_max_length": 1000000000000000019884624838656,
                  "pad_token": None, "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
                  "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False}
        special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return config, special_map


def tokenizer_files(arch: str) -> tuple[str, ...]:
    files = ("tokenizer.json", "tokenizer_config.json")
    return files + (("special_tokens_map.json",) if arch in LLAMA_STYLE else ())


def write_tokenizer(arch: str, directory: Path) -> None:
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(_tokenizer_json(arch), encoding="utf-8")
    config, special_map = _tokenizer_config(arch)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    if arch in LLAMA_STYLE:  # the Llama-family repos have special_tokens_map.json, DeepSeek and Qwen do not
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False)
                                                           + "\n", encoding="utf-8")


def raw_tokenizer(arch: str):
    """The trained `tokenizers.Tokenizer` itself (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(arch))


# --- config.json / generation_config.json -------------------------------------------------------------------

def hub_config(arch: str, phi_mscales: tuple[float, float] | None = None,
               original_max_position_embeddings: int | None = None) -> dict:
    """config.json of the tiny checkpoint, in the real repository's format and field set."""
    ids = special_ids(arch)
    vocab = TOKENIZER_LAYOUT[arch][2]
    if arch == "dsv2":
        rope_scaling = dict(DSV2_ROPE_SCALING)
        if original_max_position_embeddings is not None:
            rope_scaling["original_max_position_embeddings"] = original_max_position_embeddings
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                         "AutoModel": "modeling_deepseek.DeepseekV2Model",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
            "aux_loss_alpha": 0.001,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": 512,
            "kv_lora_rank": 64,
            "max_position_embeddings": 163840,
            "model_type": "deepseek_v2",
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": NUM_EXPERTS,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "num_attention_heads": 4,
            "num_experts_per_tok": TOP_K,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "pretraining_tp": 1,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "rms_norm_eps": 1e-06,
            "rope_scaling": rope_scaling,
            "rope_theta": 10000,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "greedy",
            "torch_dtype": "bfloat16",
            "transformers_version": "4.33.1",
            "use_cache": True,
            "v_head_dim": 32,
            "vocab_size": vocab,
        }
    if arch == "qwen":
        return {
            "architectures": ["Qwen2MoeForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": ids["bos"],
            "decoder_sparse_step": 1,
            "eos_token_id": ids["eos"],
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": 512,
            "max_position_embeddings": 8192,
            "max_window_layers": 21,
            "model_type": "qwen2_moe",
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "norm_topk_prob": False,
            "num_attention_heads": 4,
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": TOP_K,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.0.dev0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab,
        }
    if arch == "phi":
        heads = 4
        half = HIDDEN // heads // 2
        short_mscale, long_mscale = phi_mscales if phi_mscales is not None else (PHI_MSCALE, PHI_MSCALE)
        original = original_max_position_embeddings or PHI_ORIGINAL_MAX_POSITIONS
        return {
            "architectures": ["PhiMoEForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_phimoe.PhiMoEConfig",
                         "AutoModelForCausalLM": "modeling_phimoe.PhiMoEForCausalLM"},
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "hidden_act": "silu",
            "hidden_dropout": 0.0,
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "input_jitter_noise": 0.01,
            "intermediate_size": EXPERT_INTERMEDIATE,
            "lm_head_bias": True,
            "max_position_embeddings": 131072,
            "model_type": "phimoe",
            "num_attention_heads": heads,
            "num_experts_per_tok": TOP_K,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "num_local_experts": NUM_EXPERTS,
            "original_max_position_embeddings": original,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": resample(PHI_LONG_FACTOR, half),
                "long_mscale": long_mscale,
                "original_max_position_embeddings": original,
                "short_factor": resample(PHI_SHORT_FACTOR, half),
                "short_mscale": short_mscale,
                "type": "longrope",
            },
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.0,
            "router_jitter_noise": 0.01,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.3",
            "use_cache": True,
            "vocab_size": vocab,
        }
    return {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 4,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": NUM_EXPERTS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": vocab,
    }


def generation_config(arch: str) -> dict:
    """generation_config.json as the repository has it (ids mapped onto the tiny vocabulary)."""
    ids = special_ids(arch)
    if arch == "dsv2":
        return {"_from_model_config": True, "bos_token_id": ids["bos"], "do_sample": True,
                "eos_token_id": ids["eos"], "temperature": 0.3, "top_p": 0.95, "transformers_version": "4.39.3"}
    if arch == "qwen":
        return {"bos_token_id": ids["bos"], "do_sample": False, "eos_token_id": ids["eos"], "max_new_tokens": 2048,
                "transformers_version": "4.37.0"}
    if arch == "phi":
        regular = TOKENIZER_LAYOUT["phi"][0]
        return {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [regular, regular + 1, regular + 7],
                "pad_token_id": regular, "transformers_version": "4.43.3"}
    return {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.36.0.dev0"}


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


def break_tokenizer(directory: Path) -> list[Path]:
    """Remove every tokenizer file (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab files)."""
    removed = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt"):
        path = Path(directory) / name
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed
