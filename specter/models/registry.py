"""Model registry: the tiny synthetic models and the full-size models with their real configs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specter.errors import SpecterError
from specter.models.calibrated import RoutingProfile

# HF `model_type` of each supported architecture -> short architecture name used in Specter.
ARCHITECTURES = {
    "deepseek_v2": "dsv2",
    "qwen2_moe": "qwen",
    "phimoe": "phi",
    "mixtral": "mixtral",
}

BYTE_VOCAB = 320  # byte-level tokenizer: 256 bytes + BOS/EOS/PAD, padded to a multiple of 64


@dataclass(frozen=True)
class ModelSpec:
    """Everything Specter needs to know about one named model.

    hf_config: keyword arguments of the HF config class (model_type selects the class).
    mem_presets: resident FP16 experts per MoE layer for each named memory setting.
    hf_repo: the official checkpoint on the Hugging Face Hub (None for tiny models).
    """

    name: str
    model_type: str
    hf_config: dict[str, Any]
    default_k: int
    mem_presets: dict[str, int]
    hf_repo: str | None = None
    description: str = ""
    aliases: tuple[str, ...] = field(default=())
    routing_profile: RoutingProfile | None = None  # weights="calibrated": fitted by scripts/fit_calibration.py
    depth_k: dict[str, int] = field(default_factory=dict)  # memory preset -> the depth experiment's best K

    def k_for(self, slots: int | None) -> int:
        """The speculation depth for `slots` resident experts per layer: the depth profile's best K of the
        memory preset with that many slots where one was measured, else `default_k`."""
        for preset, preset_slots in self.mem_presets.items():
            if preset_slots == slots and preset in self.depth_k:
                return self.depth_k[preset]
        return self.default_k

    @property
    def is_tiny(self) -> bool:
        return self.hf_repo is None

    @property
    def num_experts(self) -> int:
        cfg = self.hf_config
        return cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]


def _tiny(model_type: str, **extra: Any) -> dict[str, Any]:
    """Small dims for CPU; hidden and expert sizes are multiples of the INT4 group size (128).

    The init std is larger than HF's 0.02 so that the routed experts, and so the INT4 draft's error,
    visibly move the logits: the draft then disagrees with the target now and then (acceptance < 1),
    and greedy text does not collapse into one repeated token.
    """
    base = dict(initializer_range=0.1,
        vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        num_experts_per_tok=2, bos_token_id=256, eos_token_id=257, pad_token_id=258,
        tie_word_embeddings=False,
    )
    base.update(extra)
    return base


_TINY_MEM = {"high": 4, "low": 2}

# RoPE of the real checkpoints (their config.json `rope_scaling` and `rope_theta`, as transformers 5 reads them).
# deepseek-ai/DeepSeek-V2-Lite: yarn; Qwen1.5-MoE-A2.7B and Mixtral-8x7B: default RoPE with theta 1e6.
DSV2_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                 beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
# microsoft/Phi-3.5-MoE-instruct config.json rope_scaling (64 = head_dim 128 / 2 entries each), as repeated
# verbatim in Ascend/MindSpeed-LLM examples/mcore/phi35/pretrain_phi35_moe_ptd.sh (LONG_FACTOR / SHORT_FACTOR,
# --long-mscale/--short-mscale 1.243163121016122, --rope-scaling-original-max-position-embeddings 4096); the
# first 8 entries of each agree with the phimoe tests of EasyDeL, which load the Hub config.
PHI_LONG_FACTOR = [
    1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.059999942779541, 1.059999942779541, 1.059999942779541, 1.059999942779541,
    1.059999942779541, 1.059999942779541, 1.0999999046325684, 1.1799999475479126, 1.1799999475479126,
    1.3700000047683716, 1.4899998903274536, 2.109999895095825, 2.8899998664855957, 3.9499998092651367,
    4.299999713897705, 6.429999828338623, 8.09000015258789, 10.690000534057617, 12.050000190734863,
    18.229999542236328, 18.84000015258789, 19.899999618530273, 21.420000076293945, 26.200000762939453,
    34.28000259399414, 34.590003967285156, 38.730003356933594, 40.22000503540039, 42.54000473022461,
    44.000003814697266, 47.590003967285156, 54.750003814697266, 56.19000244140625, 57.44000244140625,
    57.4900016784668, 61.20000076293945, 61.540000915527344, 61.75, 61.779998779296875,
    62.06999969482422, 63.11000061035156, 63.43000030517578, 63.560001373291016, 63.71000289916992,
    63.92000198364258, 63.94000244140625, 63.94000244140625, 63.96000289916992, 63.980003356933594,
    64.0300064086914, 64.0300064086914, 64.0300064086914, 64.04000854492188, 64.10000610351562,
    64.19000244140625, 64.20999908447266, 64.75, 64.95999908447266,
]
PHI_SHORT_FACTOR = [
    1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.059999942779541,
    1.059999942779541, 1.0699999332427979, 1.0699999332427979, 1.0699999332427979, 1.0699999332427979,
    1.1399999856948853, 1.159999966621399, 1.159999966621399, 1.159999966621399, 1.159999966621399,
    1.1799999475479126, 1.1999999284744263, 1.3199999332427979, 1.3399999141693115, 1.3499999046325684,
    1.3999998569488525, 1.4799998998641968, 1.4999998807907104, 1.589999794960022, 1.6499998569488525,
    1.71999990940094, 1.8999998569488525, 1.9099998474121094, 1.9099998474121094, 1.9899998903274536,
    1.9999998807907104, 1.9999998807907104, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257, 2.0999999046325684,
    2.319999933242798, 2.419999837875366, 2.5899999141693115, 2.7899999618530273,
]
PHI_MSCALE = 1.243163121016122  # short_mscale = long_mscale in Phi-3.5-MoE-instruct
THETA_1E6 = dict(rope_type="default", rope_theta=1000000.0)


def phi_rope(short_factor: list[float], long_factor: list[float], switch: int = 4096) -> dict:
    """Phi-3.5-MoE's longrope: short factors up to position `switch` (original_max_position_embeddings), long after."""
    return dict(rope_type="longrope", rope_theta=10000.0, short_factor=list(short_factor),
                long_factor=list(long_factor),
                short_mscale=PHI_MSCALE, long_mscale=PHI_MSCALE, original_max_position_embeddings=switch)


def resample(values: list[float], n: int) -> list[float]:
    """`values` at n evenly spaced places (a tiny model's head_dim / 2 factors from the real list)."""
    return [values[round(i * (len(values) - 1) / max(n - 1, 1))] for i in range(n)]
_INF = float("inf")

# weights="calibrated": fitted by scripts/fit_calibration.py to the real checkpoints' routing-locality.tsv rows
# (factor weights and run lengths) and to the paper's acceptance range (accept_gain; RTN draft, reduced depth).
_MIXTRAL_ROW = (("LRU@0.5", 0.17), ("LRU@1", 0.37), ("LRU@2", 0.61), ("LRU@4", 1.0), ("Belady@1", 0.59),
                ("Belady@2", 0.82))
_TINY_PROFILE = RoutingProfile(  # tiny-mixtral: 8 experts top-2, as Mixtral: its row
    factors=((0.31655, 3.0007), (0.4388, 56.616), (0.0001, _INF)), token_weight=1.0,
    accept_gain=15.0,  # set on Specter's measured acceptance (0.971, K=4): at hidden 128 the draft's own KV
                       # moves its hidden states, and the analytic fit (18.0) would give 0.938
    target=_MIXTRAL_ROW, source="routing-locality.tsv: Mixtral-8x7B-v0.1 (8 experts, top-2); acceptance 0.965 (RTN)")

_SPECS = [
    ModelSpec(
        "tiny-dsv2", "deepseek_v2",
        _tiny("deepseek_v2", moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
              first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
              qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=4, topk_method="greedy",
              n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False),
        default_k=4, mem_presets=_TINY_MEM, description="DeepSeek-V2 architecture, tiny random weights",
        aliases=("tiny",),
    ),
    ModelSpec(
        "tiny-qwen", "qwen2_moe",
        _tiny("qwen2_moe", moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8,
              decoder_sparse_step=1, norm_topk_prob=False, use_sliding_window=False),
        default_k=4, mem_presets=_TINY_MEM, description="Qwen2-MoE architecture, tiny random weights",
    ),
    ModelSpec(
        "tiny-phi", "phimoe",
        _tiny("phimoe", num_local_experts=8, initializer_range=0.05, sliding_window=None, attention_bias=True,
              lm_head_bias=True, rms_norm_eps=1e-5,
              rope_parameters=phi_rope(resample(PHI_SHORT_FACTOR, 16), resample(PHI_LONG_FACTOR, 16), switch=256)),
        default_k=4, mem_presets=_TINY_MEM, description="PhiMoE architecture, tiny random weights",
    ),
    ModelSpec(
        "tiny-mixtral", "mixtral",
        _tiny("mixtral", num_local_experts=8, initializer_range=0.05, sliding_window=None),
        default_k=4, mem_presets=_TINY_MEM, description="Mixtral architecture, tiny random weights",
        routing_profile=_TINY_PROFILE,
    ),
    ModelSpec(
        "dsv2", "deepseek_v2",
        dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
             n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
             q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
             topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
             norm_topk_prob=False, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_parameters=DSV2_ROPE,
             bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False),
        default_k=16, mem_presets={"high": 16, "low": 4}, hf_repo="deepseek-ai/DeepSeek-V2-Lite",
        depth_k={"high": 16, "low": 32},  # results/reference/calibrated-h200/depth-s14-dsv2-*/best_k.json
        description="DeepSeek-V2-Lite (16B, 64 routed experts top-6)",
        routing_profile=RoutingProfile(  # fitted at full depth on the H200 (float32, 6 prompts x 128 tokens)
            factors=((0.9964, 3.0375), (0.4120, 14.447), (0.3025, _INF)), token_weight=1.0, accept_gain=350.38,
            embed_scale=12.0, target=(("LRU@0.5", 0.13), ("LRU@1", 0.28), ("LRU@2", 0.41), ("LRU@4", 0.62),
                                      ("Belady@1", 0.48), ("Belady@2", 0.65)),
            source="routing-locality.tsv: DeepSeek-V2-Lite; acceptance 0.978 (RTN)"),
    ),
    ModelSpec(
        "qwen", "qwen2_moe",
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
             shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, decoder_sparse_step=1,
             norm_topk_prob=False, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_parameters=THETA_1E6,
             use_sliding_window=False, bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=False),
        default_k=8, mem_presets={"high": 15, "low": 8}, hf_repo="Qwen/Qwen1.5-MoE-A2.7B",
        depth_k={"high": 16, "low": 16},  # results/reference/depth-qwen-high-h100, depth-qwen-low-h100
        description="Qwen1.5-MoE-A2.7B (14B, 60 routed experts top-4)",
        routing_profile=RoutingProfile(  # fitted at full depth on the H200 (float32, 6 prompts x 128 tokens)
            factors=((1.0428, 1.5079), (0.4052, 50.735), (0.3012, _INF)), token_weight=1.0, accept_gain=454.63,
            embed_scale=12.0, target=(("LRU@0.5", 0.09), ("LRU@1", 0.19), ("LRU@2", 0.28), ("LRU@4", 0.43),
                                      ("Belady@1", 0.38), ("Belady@2", 0.53)),
            source="routing-locality.tsv: Qwen1.5-MoE-A2.7B; acceptance 0.965 (RTN)"),
    ),
    ModelSpec(
        "phi", "phimoe",
        dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2,
             max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None, attention_bias=True,
             lm_head_bias=True, rope_parameters=phi_rope(PHI_SHORT_FACTOR, PHI_LONG_FACTOR),
             bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False),
        default_k=16, mem_presets={"high": 2, "low": 1}, hf_repo="microsoft/Phi-3.5-MoE-instruct",
        description="Phi-3.5-MoE (42B, 16 experts top-2, longrope)",
        routing_profile=RoutingProfile(  # fitted at the real depth on an H200 (float16, 6 prompts x 128 tokens):
            # factors fitted on the simulation with token_pick 0.06, the slow and popularity weights then x1.3
            # (48-sequence simulation plus the build's measured offset), built by fit_calibration.py --models phi
            # --layers 0 --device cuda --dtype float16 --clear-routing --token-pick 0.06 --factors ... --rounds 0
            # (results/reference/calibrated-fit/h200-phi-real-depth-s28-fit-pick.log): max error 0.019, mean
            # 0.014, Specter's acceptance 0.959, tokens equal to the resident target's
            factors=((0.3055, 1.5194), (2.1141, 58.6346), (1.5785, _INF)), token_weight=1.0, accept_gain=8.0942,
            embed_scale=12.0, target=(("LRU@0.5", 0.23), ("LRU@1", 0.42), ("LRU@2", 0.65), ("LRU@4", 0.85),
                                      ("Belady@1", 0.59), ("Belady@2", 0.78)),
            source="routing-locality.tsv: Phi-3.5-MoE; acceptance 0.959 (RTN, measured at the real depth)",
            clear_routing=True, token_pick=0.06),
    ),
    ModelSpec(
        "mixtral", "mixtral",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None, rope_parameters=THETA_1E6,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        default_k=8, mem_presets={"high": 4, "low": 2}, hf_repo="mistralai/Mixtral-8x7B-v0.1",
        description="Mixtral-8x7B (47B, 8 experts top-2)",
        routing_profile=RoutingProfile(  # factors fitted on the CPU at 1 layer (float32, 6 prompts x 128 tokens,
            # --rounds 4); at the real depth on an H200 (float16) they give max error 0.026, mean 0.014, and the
            # gain is fitted there: fit_calibration.py --models mixtral --layers 0 --device cuda --dtype float16
            # --factors 0.5822:2.9798 0.4129:54.970 0.3092:inf (calibrated-fit/h200-mixtral-real-depth-s27-gain.log)
            factors=((0.5822, 2.9798), (0.4129, 54.970), (0.3092, _INF)), token_weight=1.0, accept_gain=9.115,
            embed_scale=12.0, target=_MIXTRAL_ROW,
            source="routing-locality.tsv: Mixtral-8x7B-v0.1; acceptance 0.955 (RTN, measured at the real depth)"),
    ),
]

REGISTRY: dict[str, ModelSpec] = {}
for _spec in _SPECS:
    REGISTRY[_spec.name] = _spec
    for _alias in _spec.aliases:
        REGISTRY[_alias] = _spec

TINY_MODELS = tuple(s.name for s in _SPECS if s.is_tiny)
FULL_MODELS = tuple(s.name for s in _SPECS if not s.is_tiny)


def get_spec(name: str) -> ModelSpec:
    """Look up a registered model by name or alias; unknown names are a one-line error."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise SpecterError(f"unknown model {name!r}; known models: {known} (or pass a checkpoint directory)") from None


def spec_for_model_type(model_type: str) -> ModelSpec:
    """The first registered full-size spec of an HF model_type (used for checkpoints loaded by path)."""
    for spec in _SPECS:
        if spec.model_type == model_type and not spec.is_tiny:
            return spec
    supported = ", ".join(sorted(ARCHITECTURES))
    raise SpecterError(f"unsupported architecture {model_type!r}; Specter supports: {supported}")
