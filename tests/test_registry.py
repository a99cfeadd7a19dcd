"""Model registry: real configs of the full-size models, tiny models, checkpoint loading from disk."""
import json

import pytest
import torch
import transformers

import specter
from specter.models.hybrid_experts import is_hf_experts
from specter.models.loading import hf_config
from specter.models.registry import FULL_MODELS, TINY_MODELS, get_spec
from specter.quant.int4 import GROUP_SIZE
from tests.conftest import hf_greedy, pristine_hf, prompt

# (MoE layers, routed experts, top-k, hidden, expert intermediate) of the real models
REAL = {"dsv2": (26, 64, 6, 2048, 1408), "qwen": (24, 60, 4, 2048, 1408), "phi": (32, 16, 2, 4096, 6400),
        "mixtral": (32, 8, 2, 4096, 14336)}


@pytest.mark.parametrize("name", FULL_MODELS)
def test_full_size_architecture_on_meta_device(name):
    """Instantiate the real architecture without memory and check its experts' shapes."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(get_spec(name)))
    experts = [m for m in model.modules() if is_hf_experts(m)]
    layers, e, k, h, i = REAL[name]
    assert len(experts) == layers and model.config.num_experts_per_tok == k
    assert tuple(experts[0].gate_up_proj.shape) == (e, 2 * i, h)
    assert h % GROUP_SIZE == 0 and i % GROUP_SIZE == 0
    assert get_spec(name).num_experts == e


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_dims_fit_the_int4_groups(name):
    model = pristine_hf(name)
    experts = [m for m in model.modules() if is_hf_experts(m)][0]
    assert all(d % GROUP_SIZE == 0 for d in experts.gate_up_proj.shape[1:])
    assert get_spec(name).is_tiny


def test_synthetic_build_is_seeded():
    a = specter.load_model("tiny-qwen", seed=3)
    b = specter.load_model("tiny-qwen", seed=3)
    c = specter.load_model("tiny-qwen", seed=4)
    wa, wb, wc = (m.experts[0].gate_up_proj for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_load_from_checkpoint_directory(tmp_path):
    """save_pretrained -> load_model(path): same config, experts hybridized, same greedy output."""
    pristine_hf("tiny-mixtral").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mixtral"
    model = specter.load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert model.spec.name == tmp_path.name and model.num_experts == 8 and model.num_moe_layers == 3
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4)).generate(prompt(), 12)
    assert out.token_ids == hf_greedy("tiny-mixtral", prompt(), 12)
