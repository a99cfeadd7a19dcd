"""Lossless speculative decoding: greedy Specter output equals HF generate token for token (float32, CPU)."""
import pytest
import torch

import specter
from baselines.target_only import TargetOnly
from tests.conftest import hf_greedy, prompt, tiny_model

PROMPTS = ["Natalia sold clips to 48 of her friends", "def fibonacci(n):", "Q: 2+2=?"]
NEW_TOKENS = 40


@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_equals_hf_generate(tiny_name, k):
    model = tiny_model(tiny_name)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=k))
    for text in PROMPTS:
        ids = prompt(text)
        out = engine.generate(ids, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == hf_greedy(tiny_name, ids, NEW_TOKENS), (tiny_name, k, text)
        assert out.stats["generated_tokens"] == NEW_TOKENS


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equals_hf_generate_other_seeds(tiny_name, seed):
    model = tiny_model(tiny_name, seed)
    ids = prompt("The tower is 324 metres tall")
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=6)).generate(ids, max_new_tokens=24)
    assert out.token_ids == hf_greedy(tiny_name, ids, 24, seed)


def test_rejections_happen_so_rollback_is_exercised():
    """The equality tests above mean something only if drafts get rejected sometimes."""
    rates = []
    for name in ("tiny", "tiny-qwen", "tiny-phi", "tiny-mixtral"):
        out = specter.SpecterEngine(tiny_model(name), specter.SpecterConfig(k=4)).generate(prompt(), 40)
        rates.append(out.stats["acceptance_rate"])
        assert 0.0 < out.stats["acceptance_rate"] <= 1.0
    assert min(rates) < 0.95


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_exact_length_and_window_bound(max_new):
    """Window length min(K, remaining - 1): never more tokens than asked, even with K > max_new."""
    model = tiny_model("tiny-qwen")
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=16)).generate(prompt(), max_new_tokens=max_new)
    assert len(out.token_ids) == max_new
    assert out.token_ids == TargetOnly(model).generate(prompt(), max_new).token_ids


def test_target_only_equals_hf_generate(tiny_name):
    ids = prompt("def fibonacci(n):")
    assert TargetOnly(tiny_model(tiny_name)).generate(ids, 20).token_ids == hf_greedy(tiny_name, ids, 20)


def test_single_token_prompt_and_1d_input():
    model = tiny_model("tiny")
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=3))
    ids = torch.tensor([256])
    assert engine.generate(ids, 10).token_ids == hf_greedy("tiny", ids.view(1, 1), 10)


def test_stops_at_eos_when_asked():
    model = tiny_model("tiny")
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4))
    full = engine.generate(prompt(), 30).token_ids
    eos = full[5]
    cut = engine.generate(prompt(), 30, eos_token_id=eos).token_ids
    assert cut == full[: full.index(eos) + 1]


def test_stats_contract():
    out = specter.SpecterEngine(tiny_model("tiny"), specter.SpecterConfig(k=4)).generate(prompt(), 16)
    for key in ("tpot_ms", "ttft_ms", "acceptance_rate", "mean_accepted_length", "iterations",
                "accepted_length_histogram", "draft_ms", "verify_ms"):
        assert key in out.stats, key
    assert out.stats["tpot_ms"] > 0 and out.stats["ttft_ms"] > 0
    hist = out.stats["accepted_length_histogram"]
    assert sum(hist.values()) in (out.stats["iterations"], out.stats["iterations"] - 1)  # last pass may draft 0
    # every verify pass commits its accepted drafts plus one target token; the prefill commits the first
    assert sum(n * c for n, c in hist.items()) + out.stats["iterations"] + 1 == 16
