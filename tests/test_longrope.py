"""Phi's longrope: past `original_max_position_embeddings` every engine recomputes the cache with the long
factors, so its tokens equal the model's own output: a full forward over the whole sequence at each step.

HF's generate() (transformers 5.17) means to do the same but loses the context there: its Phi override drops
the cache, and the generic input preparation still feeds only the newest token. The reference here is
therefore the uncached forward, not generate().
"""
import dataclasses

import pytest
import torch

import specter
import specter.speculative.state
from baselines.specmoeoff.engine import SpecMoEOff, SpecMoEOffConfig
from baselines.target_only import TargetOnly
from specter.errors import SpecterError
from specter.models.hybrid import hybridize
from specter.models.loading import build_synthetic
from specter.models.registry import get_spec
from specter.models.tokenizer import ByteTokenizer

SWITCH = 24  # a small original_max_position_embeddings, so that 40 new tokens cross it


def longrope_phi(switch: int = SWITCH):
    """tiny-phi with longrope switching at `switch` and unequal mscales (the switch changes the numbers)."""
    base = get_spec("tiny-phi")
    rope = {**base.hf_config["rope_parameters"], "original_max_position_embeddings": switch,
            "short_mscale": 1.0, "long_mscale": 1.3}
    spec = dataclasses.replace(base, hf_config={**base.hf_config, "rope_parameters": rope})
    hf = build_synthetic(spec, torch.device("cpu"), torch.float32, seed=1)
    return spec, hf


@torch.no_grad()
def uncached_greedy(hf, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens where each step is one forward over the whole sequence (no KV cache)."""
    tokens = ids
    for _ in range(n):
        tokens = torch.cat([tokens, hf(tokens).logits[:, -1:].argmax(dim=-1)], dim=1)
    return tokens[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference():
    spec, hf = longrope_phi()
    ids = torch.tensor([[256, *b"Natalia sold"]])  # 13 tokens: the switch falls inside the 40 new ones
    expected = uncached_greedy(hf, ids, 40)
    spec, twin = longrope_phi()  # the same seeded weights, hybridized
    return ids, expected, hybridize(twin, spec, ByteTokenizer(spec.hf_config["vocab_size"]))


def test_target_only_specter_and_specmoeoff_equal_the_uncached_model_across_the_switch(reference):
    ids, expected, model = reference
    assert TargetOnly(model).generate(ids, 40).token_ids == expected
    for k in (1, 4, 7):
        assert specter.SpecterEngine(model, specter.SpecterConfig(k=k)).generate(ids, 40).token_ids == expected, k
    offloaded = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=3))
    assert offloaded.generate(ids, 40).token_ids == expected
    smo = SpecMoEOff(model, SpecMoEOffConfig(slots=3, fixed_k=4))
    assert smo.generate(ids, 40).token_ids == expected


def test_keeping_the_short_factor_cache_would_differ(reference, monkeypatch):
    """The check above can fail: without the recompute, the tokens past the switch are not the model's."""
    ids, expected, model = reference
    monkeypatch.setattr(specter.speculative.state, "rope_switch", lambda config: None)
    assert TargetOnly(model).generate(ids, 40).token_ids != expected


def test_a_batch_that_would_cross_the_switch_is_refused(reference):
    ids, _, model = reference
    with pytest.raises(SpecterError, match="past this longrope model's switch at 24"):
        TargetOnly(model).generate([ids, ids[:, :5]], 40)
    assert len(TargetOnly(model).generate([ids, ids[:, :5]], 8)) == 2  # short of the switch: fine
