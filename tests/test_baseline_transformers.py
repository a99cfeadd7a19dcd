"""Transformers baseline: HF generate() with Specter's target weights equals target-only; budget; availability."""
from __future__ import annotations

import sys

import pytest
import torch

import specter
from baselines.hf_transformers import (
    Transformers,
    make_transformers,
    placement,
    weights_budget,
)
from baselines.target_only import TargetOnly
from specter.errors import SpecterError
from specter.device.budget import plan_memory
from tests.conftest import prompt, tiny_model

NEW = 16


def test_greedy_equals_target_only_with_per_token_times(tiny_name):
    model = tiny_model(tiny_name)
    want = TargetOnly(model).generate(prompt(), NEW).token_ids
    system = make_transformers(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    out = system.generate(prompt(), NEW)
    assert out.token_ids == want, tiny_name
    stats = out.stats
    assert stats["generated_tokens"] == NEW  # one streamer commit per generated token, none for the prompt
    assert 0 < stats["ttft_ms"] < stats["e2e_ms"] and stats["tpot_ms"] > 0
    layers = model.hf.config.num_hidden_layers
    assert (stats["device_map"], stats["gpu_layers"], stats["cpu_layers"]) == ("cpu", 0, layers)
    plan = plan_memory(model.spec, model.hf.config, model.dtype)
    assert stats["gpu_budget_bytes"] == plan.bytes_for(2)
    assert stats["weights_budget_bytes"] == plan.non_expert_bytes + plan.draft_bytes + 2 * plan.num_moe_layers * plan.expert_bytes


def test_weights_budget_leaves_specter_kv_and_workspace_reserve():
    plan = plan_memory(tiny_model("tiny-mixtral").spec, tiny_model("tiny-mixtral").hf.config, torch.float16)
    assert weights_budget(plan, 4) == plan.bytes_for(4) - plan.kv_bytes - plan.workspace_bytes
    system = Transformers(tiny_model("tiny-mixtral"))  # Specter keeping every expert resident
    assert system.budget == plan_memory(system.model.spec, system.model.hf.config, system.model.dtype).bytes_for(8)


def test_placement_counts_layers_on_gpu_and_offloaded():
    layers = ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.10"]
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.layers.2.self_attn": 0, "model.layers.2.mlp": "cpu", "model.layers.10": 0, "lm_head": "cpu"}
    assert placement(device_map, layers) == {"gpu_layers": 2, "cpu_layers": 2}
    assert placement({"": 0}, layers) == {"gpu_layers": 4, "cpu_layers": 0}
    assert placement({"model": "cpu", "lm_head": 0}, layers) == {"gpu_layers": 0, "cpu_layers": 4}


def test_unavailable_without_accelerate(monkeypatch):
    system = Transformers(tiny_model("tiny-qwen"))
    assert system.available() == (True, "")
    monkeypatch.setitem(sys.modules, "accelerate", None)  # `import accelerate` now raises ImportError
    ok, reason = system.available()
    assert not ok and "accelerate" in reason
    with pytest.raises(SpecterError, match="accelerate"):
        system.generate(prompt(), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
def test_offloaded_layers_on_cuda_decode_like_target_only(name):
    model = specter.load_model(name, device="cuda", dtype=torch.float32)
    want = TargetOnly(model).generate(prompt(), 32).token_ids
    system = Transformers(model, 2)
    system.weights_budget = 9 * 1024**2  # a decoder layer is ~3.5 MB: one fits beside the offload buffer
    out = system.generate(prompt(), 32)
    assert out.stats["device_map"] == "accelerate" and out.stats["gpu_layers"] >= 1 and out.stats["cpu_layers"] >= 1
    assert out.token_ids == want and out.stats["generated_tokens"] == 32
