"""Model registry: real configs of the full-size models, tiny models, checkpoint loading from disk."""
import copy
import json

import pytest
import torch
import transformers

import specter
from specter.errors import SpecterError
from specter.models.hybrid_experts import is_hf_experts
from specter.models.loading import default_dtype, hf_config, stored_dtype
from specter.models.registry import FULL_MODELS, TINY_MODELS, get_spec
from specter.models.tokenizer import ByteTokenizer
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
    with pytest.raises(SpecterError, match="no usable tokenizer in .*tokenizer='byte'"):
        specter.load_model(tmp_path, device="cpu", dtype=torch.float32)  # never a silent byte tokenizer
    model = specter.load_model(tmp_path, device="cpu", dtype=torch.float32, tokenizer="byte")
    assert isinstance(model.tokenizer, ByteTokenizer)
    assert model.spec.name == tmp_path.name and model.num_experts == 8 and model.num_moe_layers == 3
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4)).generate(prompt(), 12)
    assert out.token_ids == hf_greedy("tiny-mixtral", prompt(), 12)


@pytest.mark.parametrize("weights", ["synthetic", "calibrated"])
def test_seeded_builds_for_cuda_default_to_bfloat16(weights, monkeypatch):
    """What a calibrated or synthetic build for CUDA is built in, read where the build checks its memory (a CPU
    machine stops there)."""
    from specter.models import loading
    seen = []

    def stop(spec, config, device, dtype, experts_on_host, **_):
        seen.append(dtype)
        raise SpecterError("stop before building")
    monkeypatch.setattr(loading, "check_build_memory", stop)
    with pytest.raises(SpecterError, match="stop before building"):
        specter.load_model("dsv2", device="cuda", weights=weights, num_layers=2)
    assert seen == [torch.bfloat16]


def test_default_dtype_follows_the_checkpoint_on_cuda_and_is_float32_on_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_dtype(cuda) == torch.bfloat16  # seeded builds, calibrated too: what the real checkpoints store
    assert default_dtype(cuda, torch.bfloat16) == torch.bfloat16 and default_dtype(cuda, torch.float16) == torch.float16
    assert default_dtype(cpu, torch.bfloat16) == torch.float32
    config = transformers.AutoConfig.for_model("mixtral", dtype="bfloat16")
    assert stored_dtype(config) == torch.bfloat16


def test_a_checkpoint_loads_in_its_stored_dtype_unless_asked(tmp_path):
    copy.deepcopy(pristine_hf("tiny-mixtral")).to(torch.bfloat16).save_pretrained(tmp_path)  # .to() is in place
    assert stored_dtype(transformers.AutoConfig.from_pretrained(tmp_path)) == torch.bfloat16
    model = specter.load_model(tmp_path, device="cpu", tokenizer="byte")
    assert model.dtype == torch.float32  # CPU default
    half = specter.load_model(tmp_path, device="cpu", dtype=torch.float16, tokenizer="byte")
    assert half.dtype == torch.float16


@pytest.mark.parametrize("damage", ["missing", "truncated", "index"])
def test_an_incomplete_download_is_a_one_line_error(tmp_path, damage):
    pristine_hf("tiny-mixtral").save_pretrained(tmp_path, max_shard_size="300KB")
    index = tmp_path / "model.safetensors.index.json"
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    if damage == "missing":
        (tmp_path / shard).unlink()
    elif damage == "truncated":
        data = (tmp_path / shard).read_bytes()
        (tmp_path / shard).write_bytes(data[: len(data) // 2])
    else:
        index.write_text("{not json")
    message = {"missing": f"incomplete: {shard}, listed in", "truncated": f"{shard} is truncated",
               "index": "is not a valid safetensors index"}[damage]
    with pytest.raises(SpecterError, match=message):
        specter.load_model(tmp_path, device="cpu", dtype=torch.float32, tokenizer="byte")


def test_a_registered_name_refuses_a_checkpoint_of_another_architecture(tmp_path, monkeypatch):
    pristine_hf("tiny-dsv2").save_pretrained(tmp_path / "mixtral")  # a DeepSeek-V2 model where Mixtral belongs
    monkeypatch.setenv("SPECTER_MODELS", str(tmp_path))
    with pytest.raises(SpecterError, match="is a deepseek_v2 model .config.json., not the mixtral of mixtral: "
                                           "pass model=dsv2"):
        specter.load_model("mixtral", device="cpu", dtype=torch.float32, tokenizer="byte")


def test_full_size_configs_carry_the_real_checkpoints_rope():
    rope = {name: hf_config(get_spec(name)).rope_parameters for name in ("dsv2", "qwen", "phi", "mixtral")}
    assert rope["dsv2"]["rope_type"] == "yarn" and rope["dsv2"]["factor"] == 40
    assert rope["dsv2"]["original_max_position_embeddings"] == 4096 and rope["dsv2"]["mscale_all_dim"] == 0.707
    assert rope["qwen"]["rope_theta"] == rope["mixtral"]["rope_theta"] == 1e6
    phi = rope["phi"]
    assert phi["rope_type"] == "longrope" and phi["original_max_position_embeddings"] == 4096
    assert len(phi["short_factor"]) == len(phi["long_factor"]) == 64  # head_dim 128 / 2
    assert phi["long_factor"][-1] > 60 > phi["short_factor"][-1] and phi["short_mscale"] == phi["long_mscale"]
    assert hf_config(get_spec("tiny-phi")).rope_parameters["rope_type"] == "longrope"  # tests see longrope too
