"""State manager: after commits and rollbacks the KV cache equals a fresh forward of the committed sequence."""
import torch
from transformers import DynamicCache

import specter
from specter.metrics import DecodeMetrics
from specter.speculative.request import OneRequest
from specter.speculative.state import StateManager, crop_cache
from tests.conftest import prompt, tiny_model


def cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def fresh_cache(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.hf.config)
    model.forward(torch.tensor([tokens]), cache, "target")
    return cache


def test_kv_after_speculation_matches_fresh_forward(tiny_name):
    model = tiny_model(tiny_name)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=5))
    state = StateManager(model, prompt())
    state.commit([int(state.prefill().argmax())], kv_keep=state.kv_length)
    call = engine.begin_request(None)
    request = OneRequest(engine, call, state, DecodeMetrics(model.device), 1000, None, lambda tokens: None)
    rejected_once = False
    for _ in range(6):  # the window loop's steps (speculative.loop), one window at a time
        k = request.next_window()
        drafted, plan = request.draft(k)
        verified = request.verify(drafted, call.verifier(plan))
        request.commit(k, verified)
        rejected_once |= verified[0] < 5
        assert state.cache.get_seq_length() == len(state.tokens) - 1  # all but the one uncached token
        for got, want in zip(cache_tensors(state.cache), cache_tensors(fresh_cache(model, state.tokens[:-1]))):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert rejected_once, "the test must cover a rollback of rejected target KV"
    assert state.uncached().tolist() == [state.tokens[-1:]]


def test_draft_scratch_is_discarded():
    model = tiny_model("tiny")
    state = StateManager(model, prompt())
    state.prefill()
    before = [t.clone() for t in cache_tensors(state.cache)]
    with state.draft_scratch():
        model.forward(torch.tensor([[1, 2, 3]]), state.cache, "draft")
        assert state.cache.get_seq_length() == state.kv_length + 3
    assert state.cache.get_seq_length() == state.kv_length
    for got, want in zip(cache_tensors(state.cache), before):
        assert torch.equal(got, want)


def test_crop_to_current_length_is_a_no_op():
    model = tiny_model("tiny-qwen")
    cache = fresh_cache(model, [256, 1, 2, 3])
    crop_cache(cache, 4)
    assert cache.get_seq_length() == 4
    crop_cache(cache, 2)
    assert cache.get_seq_length() == 2


def test_static_cache_decoding_equals_hf_generate(tiny_name):
    """The CUDA path's static KV cache (rollback = moving its device-side length) is lossless too."""
    from specter.speculative.state import new_static_cache
    from tests.conftest import hf_greedy

    model = tiny_model(tiny_name)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4))
    cache = new_static_cache(model, 96)
    engine._static_cache = lambda length: cache
    for text in ("Natalia sold clips", "def f(x):"):
        out = engine.generate(prompt(text), 32)
        assert out.token_ids == hf_greedy(tiny_name, prompt(text), 32)
    assert out.stats["draft_graph"] == "off"  # no CUDA here: eager draft steps over the static cache
