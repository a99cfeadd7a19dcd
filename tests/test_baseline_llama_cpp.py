"""The llama.cpp baseline: real GGUF conversion and decoding on tiny models, honest available(), GPU layer arithmetic."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from transformers import AutoTokenizer

from baselines import gguf_convert
from baselines.gguf_convert import converter_root, unconvertible, write_byte_tokenizer
from baselines.llama_cpp import (
    LlamaCppBaseline,
    gpu_layers_that_fit,
    offload_order_bytes,
)
from baselines.target_only import TargetOnly
from experiments.systems import build_system
from specter.config import SpecterConfig
from specter.models.loading import hf_config
from specter.models.registry import get_spec
from specter.models.tokenizer import ByteTokenizer
from specter.device.budget import GB, plan_memory
from tests.conftest import prompt, tiny_model

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(
    not HAS_LLAMA_CPP, reason='llama-cpp-python not installed: scripts/setup_llamacpp.sh or pip install -e ".[llamacpp]"')
PROMPTS = [prompt(), prompt("def fibonacci(n):")]
NEW_TOKENS = 32


def prefix_match(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_gpu_layers_stop_at_the_first_layer_that_does_not_fit():
    assert gpu_layers_that_fit(10, 2, [1, 3, 3, 3]) == 3  # 1+3+3 = 7 <= 8, the next 3 is more than the 1 left
    assert gpu_layers_that_fit(10, 2, [1, 2, 2]) == 3  # everything fits
    assert gpu_layers_that_fit(10, 2, [9, 1]) == 0  # whole layers only, in order
    assert gpu_layers_that_fit(1, 2, [0.5]) == 0  # budget below the reserved bytes


def test_offload_order_is_output_head_then_last_layers_with_their_kv():
    config = tiny_model("tiny-qwen").hf.config  # hidden 128, vocab 320, 3 layers, 2 KV heads of 32
    order = offload_order_bytes(config, 4, n_ctx=512)
    assert len(order) == 4
    assert order[0] == (128 + 128 * 320) * 4  # final norm + lm_head, f32
    kv = 2 * 2 * 32 * 4 * 512
    assert order[1] - kv == pytest.approx(sum(order[1:]) / 3 - kv)  # identical decoder layers
    assert order[1] > 8 * 3 * 256 * 128 * 4 + kv  # at least the 8 routed experts


def test_full_size_qwen_gpu_layers_from_specter_budget():
    """Qwen1.5-MoE at mem=high (15 slots), fp16: Specter's bytes hold some of llama.cpp's layers, not all."""
    spec, config = get_spec("qwen"), hf_config(get_spec("qwen"))
    plan = plan_memory(spec, config, torch.float16)
    order = offload_order_bytes(config, 2, n_ctx=512)
    budget = plan.bytes_for(spec.mem_presets["high"])
    n = gpu_layers_that_fit(budget, plan.workspace_bytes, order)
    print(f"\nqwen mem=high: budget {budget / GB:.2f} GB, layer {order[1] / GB:.3f} GB -> n_gpu_layers {n} of 25")
    assert 0 < n < len(order)
    assert sum(order[:n]) <= budget - plan.workspace_bytes < sum(order[:n + 1])


def test_unconvertible_reasons():
    assert "26-27 layers" in unconvertible(tiny_model("tiny-dsv2").hf.config)  # no q_lora_rank, 3 layers
    assert unconvertible(hf_config(get_spec("dsv2"))) is None  # DeepSeek-V2-Lite: 27 layers
    for name in ("tiny-qwen", "tiny-mixtral", "tiny-phi"):
        assert unconvertible(tiny_model(name).hf.config) is None


def test_byte_tokenizer_ids_are_specter_ids(tmp_path):
    model = tiny_model("tiny-qwen")
    config = model.hf.config
    write_byte_tokenizer(tmp_path, config.vocab_size, model.tokenizer)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo, wörld!\n"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode())
    assert tok.convert_tokens_to_ids(["<s>", "</s>", "<pad>"]) == [256, 257, 258]
    assert max(tok.get_vocab().values()) < config.vocab_size
    write_byte_tokenizer(tmp_path / "mixtral", 32000, ByteTokenizer(32000))  # full size: config BOS 1 is not used
    assert AutoTokenizer.from_pretrained(tmp_path / "mixtral").convert_tokens_to_ids("<s>") == 256


def test_available_is_honest_without_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    ok, reason = LlamaCppBaseline(tiny_model("tiny-qwen")).available()
    assert not ok
    assert 'pip install -e ".[llamacpp]"' in reason and "GGML_CUDA=on" in reason


def test_available_names_missing_converter_source(monkeypatch, tmp_path):
    if not HAS_LLAMA_CPP:
        monkeypatch.setitem(sys.modules, "llama_cpp", type(sys)("llama_cpp"))  # importable stand-in
    monkeypatch.setenv("SPECTER_LLAMACPP_SRC", str(tmp_path / "none"))
    ok, reason = LlamaCppBaseline(tiny_model("tiny-qwen")).available()
    assert not ok and "setup_llamacpp.sh" in reason and str(tmp_path / "none") in reason


@needs_llama_cpp
def test_unconvertible_architecture_is_unavailable_with_its_reason():
    ok, reason = LlamaCppBaseline(tiny_model("tiny-dsv2")).available()
    assert not ok and "q_lora_rank" in reason


@pytest.fixture(scope="module")
def converter():
    if converter_root() is None:
        gguf_convert.fetch_source()  # CI runs scripts/setup_llamacpp.sh first; this is the same step
    return converter_root()


@needs_llama_cpp
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
def test_greedy_tokens_equal_target_only_in_f32(name, converter):
    model = tiny_model(name)
    system = LlamaCppBaseline(model)
    assert system.available() == (True, "")
    try:
        for ids in PROMPTS:
            reference = TargetOnly(model).generate(ids, NEW_TOKENS).token_ids
            result = system.generate(ids, NEW_TOKENS)
            agree = prefix_match(result.token_ids, reference)
            print(f"\n{name}: llama.cpp f32 agrees with target-only on {agree}/{NEW_TOKENS} tokens "
                  f"(convert {system.convert_s:.1f} s, TPOT {result.stats['tpot_ms']:.2f} ms)")
            assert result.token_ids == reference  # measured: 32/32 on both prompts (f32 weights, f32 KV)
            stats = result.stats
            assert stats["generated_tokens"] == NEW_TOKENS and math.isfinite(stats["tpot_ms"])
            assert stats["ttft_ms"] <= stats["e2e_ms"] and stats["n_gpu_layers"] == 0
            assert stats["gguf_dtype"] == "f32"
        gguf = system.gguf_path()
        assert system.generate(PROMPTS[0], 8).token_ids == reference_prefix(model, 8)  # no KV carried over
        assert "llama_cpp" not in sys.modules  # llama.cpp ran in its worker: never loaded beside torch
        assert system.gguf_path() == gguf  # converted once
    finally:
        system.close()
    assert not gguf.exists()


def reference_prefix(model, n: int) -> list[int]:
    return TargetOnly(model).generate(PROMPTS[0], n).token_ids


@needs_llama_cpp
def test_phimoe_converts_and_runs_with_llama_cpp_numerics(converter):
    """llama.cpp's PHIMOE graph uses RMSNorm and softmax top-k weights; HF PhiMoE uses LayerNorm and
    sparsemixer weights, so tokens diverge from the start (with HF patched to llama.cpp's choices: 32/32)."""
    model = tiny_model("tiny-phi")
    system = build_system("llama_cpp", model, SpecterConfig(resident_experts_per_layer=2))
    try:
        result = system.generate(PROMPTS[0], NEW_TOKENS)
    finally:
        system.close()
    reference = TargetOnly(model).generate(PROMPTS[0], NEW_TOKENS).token_ids
    agree = sum(a == b for a, b in zip(result.token_ids, reference))
    print(f"\ntiny-phi: llama.cpp matches target-only at {agree}/{NEW_TOKENS} positions "
          f"(prefix {prefix_match(result.token_ids, reference)})")
    assert len(result.token_ids) == NEW_TOKENS and system.name == "llama_cpp"
    assert all(0 <= t < model.hf.config.vocab_size for t in result.token_ids)


def test_system_option_file_builds_the_baseline():
    system = build_system("llama_cpp", tiny_model("tiny-qwen"), SpecterConfig(resident_experts_per_layer=2))
    assert isinstance(system, LlamaCppBaseline) and system.slots == 2 and system.outtype == "f32"
