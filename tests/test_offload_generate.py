"""Offloaded decoding: lossless under the tightest budget, ablations, stats, exact slot memory."""
import dataclasses

import pytest
import torch
from transformers import DynamicCache

import specter
import specter.engine as engine_module
from baselines.target_only import TargetOnly
from specter.hooks import attributes_set
from specter.kernels.moe_align import MoEWorkspace
from specter.offload.runtime import SPARE_ROWS, offload_experts
from specter.verify.residency import ResidencyManager, VerifyOptions
from tests.conftest import hf_greedy, prompt, tiny_model

NEW = 32


def fresh(name: str) -> specter.HybridMoEModel:
    """Offloading moves the experts out of the model, so these tests never use the shared cached models."""
    return specter.load_model(name, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("slots", [1, 3])
def test_greedy_with_offload_equals_hf_generate(tiny_name, slots):
    model = fresh(tiny_name)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=slots))
    for text in ("Natalia sold clips", "def f(x):"):
        out = engine.generate(prompt(text), NEW)
        assert out.token_ids == hf_greedy(tiny_name, prompt(text), NEW), (tiny_name, slots, text)
        assert out.stats["misses"] > 0 and out.stats["h2d_bytes"] > 0
        assert out.stats["verify_host_ms"] > out.stats["verify_host_wait_ms"] >= 0
        host_parts = out.stats["verify_host_load_ms"] + out.stats["verify_host_wave_ms"] + out.stats["verify_host_wait_ms"]
        assert out.stats["verify_host_load_ms"] > 0 and out.stats["verify_host_wave_ms"] > 0
        assert host_parts <= out.stats["verify_host_ms"]


@pytest.mark.parametrize("variant", [dict(paper=True), dict(paper=True, prefetch=False),
                                     dict(paper=True, expert_wise=False), dict(paper=True, eviction="lookahead"),
                                     dict(paper=True, eviction="popularity"), dict(k=16),
                                     dict(pooled_slots=2, resident_experts_per_layer=3), dict(prefetch=False)])
def test_ablations_stay_lossless(variant):
    model = fresh("tiny-qwen")
    fields = {"k": 6, "resident_experts_per_layer": 2, **variant}
    config = specter.SpecterConfig.paper(**fields) if fields.pop("paper", False) else specter.SpecterConfig(**fields)
    out = specter.SpecterEngine(model, config).generate(prompt(), NEW)
    assert out.token_ids == hf_greedy("tiny-qwen", prompt(), NEW)
    if variant.get("prefetch") is False:
        assert out.stats["prefetch_loads"] == 0 and out.stats["prefetch_trace"] == []
    else:
        assert out.stats["prefetch_loads"] > 0


def test_offloaded_target_forward_is_bitwise_the_resident_one():
    resident, offloaded = tiny_model("tiny-mixtral"), fresh("tiny-mixtral")
    offload_experts(offloaded, 1)
    ids = prompt()
    want = resident.forward(ids, DynamicCache(config=resident.hf.config))
    got = offloaded.forward(ids, DynamicCache(config=offloaded.hf.config))
    assert torch.equal(got, want)
    runtime = offloaded.offload  # token-wise: GEMVs, same math up to rounding
    executor = ResidencyManager(runtime.cache, runtime.routing, VerifyOptions(expert_wise=False), MoEWorkspace())
    with attributes_set(offloaded.experts, target_executor=executor):
        token_wise = offloaded.forward(ids, DynamicCache(config=offloaded.hf.config))
    torch.testing.assert_close(token_wise, want, atol=1e-5, rtol=1e-5)
    assert all(m.target_executor is runtime.residency for m in offloaded.experts)


def test_exactly_the_configured_slots_live_on_the_device():
    model = fresh("tiny")
    runtime = offload_experts(model, 2)
    for module in model.experts:
        assert not hasattr(module, "gate_up_proj") and not hasattr(module, "down_proj")
    module, rows = model.experts[0], model.num_moe_layers * 2 + runtime.cache.spare_rows
    assert runtime.cache.pool.shape == (rows, 3 * module.intermediate_dim * module.hidden_dim)
    assert runtime.store.total_bytes == model.num_moe_layers * model.num_experts * runtime.store.expert_bytes
    offload_experts(model, 3)  # another budget: a new cache over the same store
    assert model.offload.cache.slots_per_layer == 3 and model.offload.store is runtime.store


def test_pooled_slots_move_rows_from_the_layers_to_the_spares_in_the_same_memory():
    """pooled_slots=N: N slots of each layer become shared spare rows lent to the verify layers (the pool keeps
    its rows); N at or above the slots per layer leaves each layer one slot; one slot per layer: off, and why."""
    model = fresh("tiny-qwen")
    layers, config = model.num_moe_layers, specter.SpecterConfig.paper(k=4, resident_experts_per_layer=3)
    specter.SpecterEngine(model, config)
    rows = model.offload.cache.pool.shape[0]
    engine = specter.SpecterEngine(model, dataclasses.replace(config, pooled_slots=2))
    cache = model.offload.cache
    assert (cache.slots_per_layer, cache.spare_rows, cache.pooled) == (1, SPARE_ROWS + 2 * layers, True)
    assert cache.pool.shape[0] == rows == 3 * layers + SPARE_ROWS and engine.mechanisms["pooled_slots"] == "on"
    out = engine.generate(prompt(), 8)
    assert out.stats["resident_experts_per_layer"] == 1 and out.token_ids == hf_greedy("tiny-qwen", prompt(), 8)
    full = specter.SpecterEngine(model, dataclasses.replace(config, pooled_slots=3))
    assert full.config.pooled_slots == 2 and full.mechanisms["pooled_slots"] == "on"
    single = specter.SpecterEngine(model, dataclasses.replace(config, pooled_slots=2, resident_experts_per_layer=1))
    assert single.config.pooled_slots == 0 and single.mechanisms["pooled_slots"].startswith("off: needs at least 2")
    assert single.generate(prompt(), 8).token_ids == out.token_ids


def test_stats_of_an_offloaded_run(monkeypatch):
    model = fresh("tiny-phi")
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2)).generate(prompt(), NEW)
    s = out.stats
    loads = s["misses"] + s["wasted_loads"] + s["prefetch_loads"]  # every copy is one of these
    assert s["h2d_bytes"] == loads * model.offload.store.expert_bytes
    assert 0 < s["misses_planned"] <= s["misses"]  # verification loads most misses on the draft's plan
    assert any(t["early_batch"] for t in s["prefetch_trace"])  # the cold start's early layers, read mid-step
    monkeypatch.setattr(engine_module, "INITIAL_CHUNK", 8)  # a Cold Start longer than the window: no prefetch,
    late = specter.SpecterConfig(k=4, resident_experts_per_layer=2)  # so the slots keep unplanned leftovers
    ahead = specter.SpecterEngine(model, late).generate(prompt(), NEW).stats
    assert ahead["prefetch_loads"] == 0 and ahead["loads_ahead"] > 0  # loaded while the previous layer ran
    assert 0 <= s["hit_rate"] <= 1 and s["hits"] >= s["hits_prefetched"]
    assert 0 < s["prefetch_precision"] <= 1 and 0 < s["prefetch_recall"] <= 1
    assert 1 <= s["working_set_mean"] <= model.num_experts and s["wait_ms"] >= 0
    assert s["prefill_h2d_bytes"] > 0 and s["decode_h2d_bytes"] == s["h2d_bytes"] - s["prefill_h2d_bytes"]
    assert s["decode_h2d_bytes_per_token"] == s["decode_h2d_bytes"] / (NEW - 1)  # the tokens TPOT counts
    assert s["decode_h2d_bytes"] >= s["window_miss_bytes"] > 0  # each needed non-resident expert: one copy at least
    no_plan = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2, prefetch=False))
    assert no_plan.generate(prompt(), NEW).stats["misses_planned"] == 0  # the ablation loads on demand only
    for key in ("draft_ms", "verify_ms", "h2d_gbps", "evictions", "prefetch_trace"):
        assert key in s
    for phase in ("draft", "verify"):  # copies are synchronous on CPU: inside the phases that issue them
        assert 0 <= s[f"copy_idle_{phase}_ms"] <= s[f"{phase}_ms"] + 1e-6
    assert s["copy_idle_verify_ms"] < s["verify_ms"] and s["copy_idle_between_ms"] >= 0
    assert s["copy_gap_slot_ms"] == 0  # synchronous CPU copies never wait for a slot's reader
    assert s["copy_gap_host_ms"] == pytest.approx(s["copy_idle_draft_ms"] + s["copy_idle_verify_ms"]
                                                  + s["copy_idle_between_ms"], rel=1e-6, abs=1e-6)


def test_target_only_with_the_same_cache_and_repeatable_runs():
    model = fresh("tiny")
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
    reference = TargetOnly(model, resident_experts_per_layer=2)
    first = engine.generate(prompt(), NEW)
    plain = reference.generate(prompt(), NEW)
    again = engine.generate(prompt(), NEW)
    assert first.token_ids == plain.token_ids == again.token_ids
    assert first.stats["misses"] == again.stats["misses"]  # the cache starts from the same state
    assert plain.stats["misses"] > 0 and "prefetch_loads" in plain.stats


def test_budget_must_fit_the_expert_count():
    with pytest.raises(ValueError, match="resident experts per layer must be in 1..8"):
        offload_experts(fresh("tiny"), 9)


@pytest.mark.parametrize("name", ["tiny", "tiny-phi"])
def test_checkpoint_loads_with_experts_straight_to_host(tmp_path, name):
    """A checkpoint read on the CPU, experts into the host store layer by layer: same greedy tokens."""
    from tests.conftest import pristine_hf

    pristine_hf(name).save_pretrained(tmp_path)
    model = specter.load_model(tmp_path, device="cpu", dtype=torch.float32, experts_on_host=True, tokenizer="byte")
    assert model.host_store is not None and not hasattr(model.experts[0], "gate_up_proj")
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=1)).generate(prompt(), 16)
    assert out.token_ids == hf_greedy(name, prompt(), 16)


def test_synthetic_build_straight_to_host_is_seeded_and_decodes():
    a = specter.load_model("tiny-qwen", device="cpu", experts_on_host=True, seed=5)
    b = specter.load_model("tiny-qwen", device="cpu", experts_on_host=True, seed=5)
    assert torch.equal(a.host_store.buffers[1], b.host_store.buffers[1])
    assert torch.equal(a.experts[0].draft_gate_up_qweight, b.experts[0].draft_gate_up_qweight)
    reference = TargetOnly(a, resident_experts_per_layer=8).generate(prompt(), 16).token_ids
    out = specter.SpecterEngine(a, specter.SpecterConfig(k=4, resident_experts_per_layer=2)).generate(prompt(), 16)
    assert out.token_ids == reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_transfer_gives_the_same_tokens_with_fewer_bytes(tiny_name, dtype):
    """Slots rebuilt from residual blobs hold the raw experts' bits, so every token and count agrees."""
    runs = {}
    for residual in (False, True):
        model = specter.load_model(tiny_name, device="cpu", dtype=dtype)
        config = specter.SpecterConfig(k=4, resident_experts_per_layer=2, residual_transfer=residual,
                                       coded_slots=False)  # the same 16-bit slots, so the same loads
        runs[residual] = (specter.SpecterEngine(model, config).generate(prompt(), NEW), model)
    (raw, _), (residual, model) = runs[False], runs[True]
    assert residual.token_ids == raw.token_ids
    wide = specter.SpecterConfig(k=4, resident_experts_per_layer=3, residual_transfer=True, pooled_slots=2)
    assert specter.SpecterEngine(model, wide).generate(prompt(), NEW).token_ids == raw.token_ids  # pooled, coded
    loads = residual.stats["misses"] + residual.stats["wasted_loads"] + residual.stats["prefetch_loads"]
    assert loads == raw.stats["misses"] + raw.stats["wasted_loads"] + raw.stats["prefetch_loads"]
    assert residual.stats["residual_decodes"] == loads > 0 and raw.stats["residual_decodes"] == 0
    store = model.offload.residuals
    assert residual.stats["h2d_bytes"] < 0.75 * raw.stats["h2d_bytes"]
    assert store.bits_per_weight() < (9.5 if dtype == torch.bfloat16 else 12.0)


def test_residual_transfer_keeps_batches_lossless():
    """A batch decodes the same tokens with residual loads as with raw copies, also with slots pooled with the spare
    rows (waves of every slot, grouped copies: the default) (bf16: a batch's GEMMs may round otherwise than one
    request's on some CPUs, so each side is compared with its own shape)."""
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    prompts = [prompt().tolist()[0], prompt("def f(x):").tolist()[0]]
    options = {"raw": dict(residual_transfer=False, pooled_slots=0), "residual": dict(pooled_slots=0),
               "pooled": dict(resident_experts_per_layer=3, pooled_slots=2)}
    runs = {}
    for name, option in options.items():
        engine = specter.SpecterEngine(model, specter.SpecterConfig(**{"k": 4, "resident_experts_per_layer": 2,
                                                                       **option}))
        runs[name] = ([r.token_ids for r in engine.generate(prompts, 12)],
                      [engine.generate(torch.tensor([p]), 12).token_ids for p in prompts],
                      engine.generate(prompts, 12)[0].stats["residual_decodes"])
    assert runs["residual"][:2] == runs["raw"][:2] == runs["pooled"][:2]
    assert runs["residual"][2] > 0 and runs["raw"][2] == 0


def test_residual_transfer_switches_itself_off_for_float32_experts():
    config = specter.SpecterConfig(k=2, resident_experts_per_layer=1, residual_transfer=True)
    out = specter.SpecterEngine(fresh("tiny"), config).generate(prompt(), 4)
    assert out.stats["mechanisms"]["residual_transfer"].startswith("off: residual_transfer needs 16-bit experts")
    assert out.stats["residual_decodes"] == 0 and out.token_ids == hf_greedy("tiny", prompt(), 4)
