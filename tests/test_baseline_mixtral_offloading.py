"""Mixtral-Offloading baselines: lossless greedy output, slot arithmetic (SC, SM), LRU swaps, state restored."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import specter
from baselines.mixtral_offloading import (
    LayerLRU,
    MixtralOffloading,
    SwapCache,
    SwapExecutor,
    make_mo_sc,
    make_mo_sm,
    same_memory_slots,
)
from baselines.target_only import TargetOnly
from specter.kernels.reference import expert_wise_moe
from specter.models.loading import hf_config
from specter.models.registry import get_spec
from specter.device.budget import MemoryPlan, plan_memory
from specter.offload.host_store import HostExpertStore
from tests.conftest import prompt, tiny_model

NEW = 16


@functools.cache
def reference(name: str) -> list[int]:
    return TargetOnly(tiny_model(name)).generate(prompt(), NEW).token_ids


def plan(draft_bytes: int, layers: int = 3, expert_bytes: int = 100, experts: int = 8) -> MemoryPlan:
    return MemoryPlan(non_expert_bytes=10**6, draft_bytes=draft_bytes, kv_bytes=10**5, workspace_bytes=10**9,
                      expert_bytes=expert_bytes, num_moe_layers=layers, num_experts=experts)


def test_greedy_equals_target_only_for_sc_sm_and_one_slot(tiny_name):
    model = tiny_model(tiny_name)
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2)
    for system in (MixtralOffloading(model, 1), make_mo_sc(model, config), make_mo_sm(model, config)):
        out = system.generate(prompt(), NEW)
        assert out.token_ids == reference(tiny_name), (tiny_name, system.name, system.slots)
        assert out.stats["generated_tokens"] == NEW and out.stats["tpot_ms"] > 0
        assert out.stats["misses"] > 0 and out.stats["h2d_copies"] == out.stats["misses"]
        assert out.stats["h2d_bytes"] == out.stats["misses"] * system.cache.store.expert_bytes
        prefill, decode = out.stats["prefill_h2d_bytes"], out.stats["decode_h2d_bytes"]
        assert prefill > 0 and prefill + decode == out.stats["h2d_bytes"]  # the prompt's loads apart
        assert out.stats["decode_h2d_bytes_per_token"] == decode / (NEW - 1)
    assert all(m.target_executor is None for m in model.experts)  # the resident model is left as it was


def test_sc_uses_specter_slots_and_sm_follows_the_budget_arithmetic():
    assert same_memory_slots(2, plan(draft_bytes=3 * 100 * 2 + 299)) == 4  # 899 // 300 = 2 extra slots
    assert same_memory_slots(2, plan(draft_bytes=299)) == 2  # less than one slot per layer buys none
    assert same_memory_slots(7, plan(draft_bytes=10**6)) == 8  # capped at the expert count
    qwen = plan_memory(get_spec("qwen"), hf_config(get_spec("qwen")), torch.float16)
    assert (qwen.num_moe_layers, qwen.num_experts, qwen.expert_bytes) == (24, 60, 3 * 1408 * 2048 * 2)
    assert qwen.draft_bytes == 24 * 60 * (3 * 1408 * 2048 // 2 + 3 * 1408 * 2048 // 128 * 2)
    assert same_memory_slots(15, qwen) == 30  # 6.42 GB of INT4 draft = 15.47 FP16 experts per layer
    model = tiny_model("tiny-qwen")
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=3)
    tiny = plan_memory(model.spec, model.hf.config, model.dtype)  # float32: 1253376 // 1179648 = 1 extra
    assert make_mo_sc(model, config).slots == 3
    assert make_mo_sm(model, config).slots == same_memory_slots(3, tiny) == 4
    assert make_mo_sc(model, specter.SpecterConfig(k=4)).slots == model.num_experts  # Specter all-resident


def test_layer_lru_evicts_the_least_recently_used_idle_expert():
    lru = LayerLRU(2)
    for expert in (0, 1):
        assert not lru.lookup(expert)
        assert lru.admit(expert) == (expert, None)  # free slots first
        lru.done(expert)
    assert lru.lookup(0)  # hit: 0 becomes most recent
    lru.done(0)
    assert not lru.lookup(2) and lru.admit(2) == (1, 1)  # 1 was least recent
    assert list(lru.slot_of) == [0, 2]
    one = LayerLRU(1)
    one.lookup(3), one.lookup(4)
    assert one.admit(3) == (0, None) and not one.can_admit()  # 3 is still needed by the running layer
    one.done(3)
    assert one.can_admit() and one.admit(4) == (0, 3)


def test_swap_cache_counters_and_staging_rotation():
    torch.manual_seed(0)
    store = HostExpertStore(1, 4, 8, 4, torch.float32, torch.device("cpu"))
    gate_up, down = torch.randn(4, 8, 8), torch.randn(4, 8, 4)  # [E, 2I, H], [E, H, I]
    store.put_layer(0, gate_up, down)
    cache = SwapCache(store, slots=2, device=torch.device("cpu"), staging=2)
    buffers = {id(b) for b in [*cache.slots[0], *cache.staging]}
    module = SimpleNamespace(moe_layer=0, num_experts=4, act_fn=torch.nn.functional.silu)
    run = SwapExecutor(cache, window=1)
    routes = [[[0, 1]], [[1, 2]], [[0, 3]], [[3, 0]]]  # one token per step, top-2: [T=1, k=2]
    for route in routes:
        idx, hidden = torch.tensor(route), torch.randn(1, 8)
        weights = torch.softmax(torch.randn(1, 2), dim=-1)
        want = expert_wise_moe(hidden, idx, weights, lambda e: (gate_up[e], down[e]), 4, module.act_fn)
        torch.testing.assert_close(run(module, hidden, idx, weights), want)
    # [0,1]: 2 misses; [1,2]: hit 1, miss 2 evicts 0; [0,3]: 2 misses evict 1 then 2; [3,0]: 2 hits
    assert cache.counters == {"hits": 3, "misses": 5, "evictions": 3}
    assert cache.streams.stats()["h2d_copies"] == 5
    assert {id(b) for b in [*cache.slots[0], *cache.staging]} == buffers and len(cache.staging) == 2
    assert cache.device_bytes == 4 * store.expert_bytes


def test_mo_then_specter_then_target_only_on_one_model():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float32)  # offloading changes it: not shared
    config = specter.SpecterConfig(k=4, resident_experts_per_layer=2)
    want = reference("tiny-qwen")
    mo = make_mo_sc(model, config)
    assert mo.generate(prompt(), NEW).token_ids == want  # experts still on the device: a private host copy
    assert specter.SpecterEngine(model, config).generate(prompt(), NEW).token_ids == want
    assert all(m.target_executor is model.offload.residency for m in model.experts)
    assert mo.generate(prompt(), NEW).token_ids == want  # now over the model's host store
    assert mo.cache.store is model.host_store
    assert all(m.target_executor is model.offload.residency for m in model.experts)
    out = TargetOnly(model, 2).generate(prompt(), NEW)
    assert out.token_ids == want and out.stats["misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-mixtral"])
def test_mo_on_cuda_equals_target_only(name):
    model = specter.load_model(name, device="cuda", dtype=torch.float16)
    want = TargetOnly(model).generate(prompt(), 32).token_ids
    for slots in (1, 3):
        out = MixtralOffloading(model, slots).generate(prompt(), 32)
        assert out.token_ids == want, (name, slots)
        assert out.stats["h2d_gbps"] > 0 and out.stats["h2d_copies"] == out.stats["misses"]
