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


@pytest.mark.parametrize("field", [dict(verify_wave=-1), dict(load_ahead_layers=-1), dict(copy_streams=3),
                                   dict(initial_chunk=0), dict(prefetch_chunk=0), dict(early_read_fraction=-0.1),
                                   dict(early_read_fraction=1.5), dict(spare_rows=-1)])
def test_bad_offload_knobs(field):
    with pytest.raises(SpecterError, match="must be"):
        specter.SpecterConfig(**field)
