"""config.json and generation_config.json of the tiny Hub-layout checkpoints (`tests/hub_checkpoints.py`).

The sizes of the tiny checkpoints, and the real repositories' values of every field that does not set a size,
with where they were found (REAL_VALUES).
"""
from __future__ import annotations

from specter.models.registry import PHI_LONG_FACTOR, PHI_MSCALE, PHI_SHORT_FACTOR, resample
from tests.hub_tokenizers import TOKENIZER_LAYOUT, special_ids

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
