"""Longrope on the device: HF's rotary numbers exactly on both sides of the switch, chosen without a host sync,
so the draft step over a static cache (what the CUDA graph captures) drafts the eager HF-rotary draft's tokens
across a request crossing the switch; draft-ahead's windows stop short of the switch as the engine's do."""
import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache

import specter
from specter.draft.ahead import DraftAhead
from specter.draft.graph import draft_step_fn
from specter.models.device_rope import install_device_longrope, rope_switch
from specter.models.hybrid import hybridize
from specter.models.hybrid_experts import DRAFT
from specter.models.loading import build_synthetic
from specter.models.registry import get_spec
from specter.models.tokenizer import ByteTokenizer
from specter.speculative.state import new_static_cache, window_length
from tests.conftest import prompt

SWITCH = 24


def longrope_spec(switch: int = SWITCH):
    """tiny-phi switching at `switch`, unequal mscales and long factors unlike the short ones."""
    base = get_spec("tiny-phi")
    rope = dict(base.hf_config["rope_parameters"])
    rope.update(original_max_position_embeddings=switch, short_mscale=1.0, long_mscale=1.3,
                long_factor=[f * 1.5 + 0.25 for f in rope["short_factor"]])
    return dataclasses.replace(base, hf_config={**base.hf_config, "rope_parameters": rope})


@pytest.fixture(scope="module")
def hf_and_hybrid():
    """The plain HF model (HF's rotary) and its hybridized twin (the rotary on the device), same weights."""
    spec = longrope_spec()
    hf = build_synthetic(spec, torch.device("cpu"), torch.float32, seed=3)
    twin = copy.deepcopy(hf)
    return hf, hybridize(twin, spec, ByteTokenizer(spec.hf_config["vocab_size"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[[0, 1, 2]], [[SWITCH - 2, SWITCH - 1]], [[SWITCH - 1, SWITCH]],
                                       [[40, 41, 42, 43]], [[3], [SWITCH + 5]], [[SWITCH - 1], [2]]])
def test_the_device_rotary_equals_hf_below_at_and_past_the_switch(hf_and_hybrid, positions, dtype):
    hf, model = hf_and_hybrid
    ids = torch.tensor(positions)
    x = torch.zeros(1, 1, dtype=dtype)
    expected = hf.model.rotary_emb(x, position_ids=ids)
    got = model.hf.model.rotary_emb(x, position_ids=ids)
    assert model.rope_on_host == ""
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), positions


def test_the_regimes_differ_so_the_check_above_can_fail(hf_and_hybrid):
    hf, _ = hf_and_hybrid
    x = torch.zeros(1, 1)
    short = hf.model.rotary_emb(x, position_ids=torch.tensor([[5]]))[0]
    long = hf.model.rotary_emb(x, position_ids=torch.tensor([[5, SWITCH]]))[0][:, :1]
    assert not torch.equal(short, long)


def test_a_rotary_it_cannot_reproduce_stays_on_the_host():
    spec = longrope_spec()
    hf = build_synthetic(spec, torch.device("cpu"), torch.float32, seed=3)
    rotary = hf.model.rotary_emb
    hf_forward = type(rotary).forward

    class Doubled(type(rotary)):  # not a (frequencies, scale) pair of longrope's
        def forward(self, x, position_ids=None):
            cos, sin = hf_forward(self, x, position_ids)
            return cos * 2, sin

    rotary.__class__ = Doubled
    reason = install_device_longrope(hf)
    assert "short regime is not a (frequencies, scale) pair" in reason
    assert "forward" not in vars(rotary)  # HF's forward stays
    model = hybridize(hf, spec, ByteTokenizer(spec.hf_config["vocab_size"]))
    assert model.rope_on_host == reason
    ahead = specter.SpecterEngine(model, specter.SpecterConfig(k=3, draft_ahead=True)).mechanisms["draft_ahead"]
    assert ahead.startswith("off: the rotary picks its regime on the host")


def test_models_without_longrope_are_left_alone():
    model = specter.load_model("tiny-qwen", device="cpu")
    assert rope_switch(model.hf.config) is None and model.rope_on_host == ""
    assert "forward" not in vars(model.hf.model.rotary_emb)


@torch.no_grad()
def eager_hf_draft(hf_model: torch.nn.Module, hybrid, ids: torch.Tensor, steps: int) -> list[int]:
    """The draft's greedy chain through HF's own rotary: `hybrid`'s INT4 experts swapped into `hf_model`
    (a twin of hybrid.hf), a dynamic cache, the positions HF computes from it."""
    twin = copy.deepcopy(hybrid)
    twin.hf.model.rotary_emb = hf_model.model.rotary_emb  # HF's rotary: its regime picked on the host
    cache = DynamicCache(config=twin.hf.config)
    logits = twin.forward(ids, cache, DRAFT)[:, -1]
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        logits = twin.forward(torch.tensor([[tokens[-1]]]), cache, DRAFT)[:, -1]
        tokens.append(int(logits.argmax()))
    return tokens


@torch.no_grad()
def captured_step_draft(model, ids: torch.Tensor, steps: int) -> list[int]:
    """The same chain as the captured draft step runs it: `draft_step_fn` over a static cache, the positions
    from the cache's device-side length, the rotary's regime chosen on the device."""
    cache = new_static_cache(model, 64)
    step = draft_step_fn(model)
    tokens = [int(model.forward(ids, cache, DRAFT)[:, -1].argmax())]
    for _ in range(steps - 1):
        tokens.append(int(step(torch.tensor([[tokens[-1]]]), cache, None, None)[0, 0]))
    return tokens


def test_the_captured_draft_step_drafts_the_eager_hf_drafts_across_the_switch(hf_and_hybrid):
    hf, model = hf_and_hybrid
    ids = prompt("Natalia sold")  # 13 tokens: 20 steps cross the switch at 24
    assert ids.shape[1] + 20 > SWITCH
    expected = eager_hf_draft(hf, model, ids, 20)
    assert captured_step_draft(model, ids, 20) == expected
    short_only = copy.deepcopy(model)
    short_only.hf.model.rotary_emb.device_rope_switch = 10**6  # never the long regime: the check can fail
    assert captured_step_draft(short_only, ids, 20) != expected


def test_a_prompt_past_the_switch_drafts_in_the_long_regime(hf_and_hybrid):
    hf, model = hf_and_hybrid
    ids = prompt("Natalia sold clips to 48 of her friends")
    assert ids.shape[1] > SWITCH
    assert captured_step_draft(model, ids, 6) == eager_hf_draft(hf, model, ids, 6)


@pytest.mark.parametrize("kv_length", [5, SWITCH - 6, SWITCH - 2, SWITCH - 1, SWITCH, SWITCH + 3])
@pytest.mark.parametrize("committed", [1, 3, 5])
def test_draft_ahead_drafts_the_window_the_engine_will_draft(hf_and_hybrid, kv_length, committed):
    """After `committed` tokens, the next window the engine drafts (StateManager.window) is the one drafted
    ahead, so no drafted-ahead window spans the switch."""
    _, model = hf_and_hybrid
    ahead = DraftAhead(model, None, compiled=False, k_max=4)
    remaining = 30
    next_kv = kv_length + committed - 1
    assert ahead.window_k(remaining, kv_length, SWITCH)(committed) == \
        window_length(min(4, remaining - committed - 1), next_kv, SWITCH)
    k = ahead.window_k(remaining, kv_length, SWITCH)(committed)
    assert k == 0 or next_kv + k < SWITCH or next_kv > SWITCH  # the window's positions stay on one side


def test_the_engine_with_draft_ahead_equals_the_uncached_model_across_the_switch(hf_and_hybrid, draft_ahead_on_cpu):
    hf, model = hf_and_hybrid
    ids = prompt("Natalia sold")
    tokens = ids
    with torch.no_grad():
        for _ in range(30):
            tokens = torch.cat([tokens, hf(tokens).logits[:, -1:].argmax(dim=-1)], dim=1)
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=3, draft_ahead=True)).generate(ids, 30)
    assert out.stats["mechanisms"]["draft_ahead"] == "on" and out.stats["draft_ahead_launches"] > 0
    assert out.token_ids == tokens[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name,kwargs", [("tiny-phi", {}), ("tiny-phi", dict(experts_on_host=True))])
def test_every_way_of_building_a_longrope_model_installs_the_device_rotary(name, kwargs):
    model = specter.load_model(name, device="cpu", **kwargs)
    assert model.rope_on_host == "" and "forward" in vars(model.hf.model.rotary_emb)
