"""Bad input: one clear error, never a silent fallback."""
import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.models.registry import get_spec
from tests.conftest import tiny_model


def test_unknown_model_names_the_known_ones():
    with pytest.raises(SpecterError, match="unknown model 'nope'.*tiny"):
        specter.load_model("nope")


def test_missing_checkpoint_path(tmp_path):
    with pytest.raises(SpecterError, match="does not exist.*download_models"):
        specter.load_model(tmp_path / "missing")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(SpecterError, match="no config.json"):
        specter.load_model(tmp_path)


def test_malformed_config_json_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v2", ')
    with pytest.raises(SpecterError, match="config.json is not a readable JSON object") as error:
        specter.load_model(tmp_path)
    assert "\n" not in str(error.value)


def test_full_size_model_without_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTER_MODELS", str(tmp_path))
    with pytest.raises(SpecterError, match="no checkpoint for 'dsv2'.*--only dsv2.*synthetic"):
        specter.load_model("dsv2")


@pytest.mark.parametrize("k", [0, -3])
def test_k_below_one(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        specter.SpecterConfig(k=k)


def test_residency_larger_than_expert_count():
    model = tiny_model("tiny")
    with pytest.raises(ValueError, match="exceeds the model's 8 routed experts"):
        specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=9))
    specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=8))


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)])
def test_bad_prompt_shape(bad):
    engine = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=2))
    with pytest.raises(SpecterError, match=r"shape \[1, T\]"):
        engine.generate(bad, 4)


def test_bad_sampling_settings():
    with pytest.raises(ValueError):
        specter.SpecterConfig(temperature=-1)
    with pytest.raises(ValueError):
        specter.SpecterConfig(top_p=0)
    assert get_spec("tiny").name == "tiny-dsv2"


@pytest.mark.parametrize("field", [dict(pooled_slots=-1), dict(pooled_slots=1.5), dict(eviction="stale"),
                                   dict(residual_transfer=1), dict(draft_ahead="yes"),
                                   dict(resident_experts_per_layer=0), dict(seed=0.5)])
def test_bad_offload_knobs(field):
    with pytest.raises(SpecterError, match="must be"):
        specter.SpecterConfig(**field)


@pytest.mark.parametrize("prompt,message", [
    (torch.tensor([[72.7, 101.0]]), "must hold integer token ids, got dtype torch.float32"),
    ([72.7, 101.0], "must hold integer token ids, got dtype torch.float"),
    (torch.tensor([[5, -1]]), "token id -1, outside this model's vocabulary"),
    (torch.tensor([[5, 10**6]]), "token id 1000000, outside this model's vocabulary"),
    (torch.tensor([[True, False]]), "must hold integer token ids, got dtype torch.bool"),
])
def test_prompts_must_be_token_ids_in_the_vocabulary(prompt, message):
    from baselines.target_only import TargetOnly
    model = tiny_model("tiny")
    for system in (specter.SpecterEngine(model, specter.SpecterConfig(k=2)), TargetOnly(model)):
        with pytest.raises(SpecterError, match=message):
            system.generate(prompt, 4)
        with pytest.raises(SpecterError, match=message):
            system.generate([prompt, [5, 6]], 4)  # a batch checks each prompt


def test_max_new_tokens_must_be_a_whole_number():
    model = tiny_model("tiny")
    for bad in (True, 2.5, 0):
        with pytest.raises(SpecterError, match="max_new_tokens must be an integer >= 1"):
            specter.SpecterEngine(model, specter.SpecterConfig(k=2)).generate(torch.tensor([[5, 6]]), bad)
