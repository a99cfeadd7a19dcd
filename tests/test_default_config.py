"""The default configuration (every mechanism that won) is lossless, and says which mechanisms ran and why not."""
import dataclasses

import pytest
import torch

import specter
from specter.config import PAPER_DESIGN
from specter.mechanisms import MECHANISMS, as_run
from specter.models.registry import get_spec
from specter.models.loading import build_synthetic
from tests.conftest import TINY_MODELS, prompt

NEW = 24


def hf_greedy_in(name: str, dtype: torch.dtype, input_ids: torch.Tensor, new: int) -> list[int]:
    """HF `generate` (greedy) on the seeded model in `dtype`, without Specter's module swap."""
    model = build_synthetic(get_spec(name), torch.device("cpu"), dtype, 0)
    out = model.generate(input_ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=get_spec(name).hf_config["pad_token_id"])
    return out[0, input_ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.usefixtures("draft_ahead_on_cpu")  # every mechanism together, draft-ahead too (in series on a CPU)
def test_the_default_equals_hf_greedy_at_tight_memory_in_bfloat16(name):
    """bfloat16 experts, so residual transfer runs (on the CPU its decode is the torch reference); 3 slots per
    layer, 2 of them pooled; draft-ahead on every model."""
    model = specter.load_model(name, device="cpu", dtype=torch.bfloat16)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3))
    ids = prompt("Natalia sold clips")
    out = engine.generate(ids, NEW)
    assert out.token_ids == hf_greedy_in(name, torch.bfloat16, ids, NEW), name
    ran = out.stats["mechanisms"]
    assert set(ran) == set(MECHANISMS)
    assert ran["residual_transfer"] == ran["pooled_slots"] == ran["prefetch"] == "on"
    assert out.stats["residual_decodes"] > 0 and engine.config.pooled_slots == 2
    assert ran["draft_ahead"] == "on"  # longrope (tiny-phi) too: its regime is picked on the device
    assert ran["cuda_graph"] == "off: no CUDA device" and ran["draft_compile"].startswith("off: no CUDA graph")


@pytest.mark.usefixtures("draft_ahead_on_cpu")
def test_batches_and_sampling_give_correct_tokens_with_draft_ahead_off_and_say_so():
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    engine = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3))
    prompts = [prompt().tolist()[0], prompt("def f(x):").tolist()[0]]
    batch = engine.generate(prompts, 12)
    singles = [engine.generate(torch.tensor([p]), 12).token_ids for p in prompts]
    reference = specter.SpecterEngine(model, specter.SpecterConfig.paper(resident_experts_per_layer=3))
    assert [r.token_ids for r in reference.generate(prompts, 12)] == [r.token_ids for r in batch]
    assert singles == [reference.generate(torch.tensor([p]), 12).token_ids for p in prompts]
    assert all(r.stats["mechanisms"]["draft_ahead"] == "off: batched requests (single requests only)" for r in batch)
    sampled = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=3, temperature=0.8))
    out = sampled.generate(prompt(), 12)
    assert out.stats["mechanisms"]["draft_ahead"] == "off: sampling (draft-ahead is greedy only)"
    assert len(out.token_ids) == 12 and all(0 <= t < model.vocab_size for t in out.token_ids)
    assert sampled.generate(prompt(), 12).token_ids == out.token_ids  # seeded: repeatable


def test_the_papers_design_has_every_new_mechanism_off():
    paper = specter.SpecterConfig.paper()
    assert all(getattr(paper, name) == value for name, value in PAPER_DESIGN.items())
    model = specter.load_model("tiny", device="cpu", dtype=torch.bfloat16)
    engine = specter.SpecterEngine(model, dataclasses.replace(paper, resident_experts_per_layer=2))
    out = engine.generate(prompt(), 8)
    for name in PAPER_DESIGN:
        assert out.stats["mechanisms"][name] == "off: not asked", name
    assert out.stats["residual_decodes"] == 0 and "draft_ahead_launches" not in out.stats


def test_mechanisms_that_cannot_apply_switch_themselves_off_with_the_reason():
    model = specter.load_model("tiny", device="cpu", dtype=torch.float32)
    resident = specter.SpecterEngine(model, specter.SpecterConfig())
    for name in ("prefetch", "residual_transfer", "pooled_slots"):
        assert resident.mechanisms[name].startswith("off: every expert resident"), name
    assert resident.config.k == model.spec.default_k  # no depth profile for the tiny models
    offloaded = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=1))
    assert offloaded.mechanisms["residual_transfer"].startswith("off: residual_transfer needs 16-bit experts")
    assert offloaded.mechanisms["pooled_slots"].startswith("off: needs at least 2 slots per layer")
    assert get_spec("dsv2").k_for(4) == 32 and get_spec("dsv2").k_for(16) == 16 and get_spec("dsv2").k_for(7) == 16
    assert offloaded.mechanisms["draft_ahead"] == "off: no CUDA device (nothing to run the draft beside the verify pass)"
    assert not offloaded.config.draft_ahead  # in series on a CPU it only adds the draft's work


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["default-bf16", "fp16"])
def test_the_whole_default_equals_the_resident_target_on_a_calibrated_full_width_model_on_cuda(dtype):
    """Every mechanism on (CUDA graph, compile, draft-ahead, residual transfer with grouped copies, pooled slots)
    on calibrated dsv2 at full width with 4 layers, in the default dtype (bf16) and fp16, 4 slots per layer
    (2 pooled): the tokens of greedy target-only decoding with every expert resident (HF's forward)."""
    from baselines.target_only import TargetOnly
    model = specter.load_model("dsv2", device="cuda", dtype=dtype, weights="calibrated", num_layers=4)
    assert model.dtype == (dtype or torch.bfloat16)
    ids = prompt("Natalia sold clips").cuda()
    reference = TargetOnly(model).generate(ids, 64).token_ids  # before the experts move to the host
    engine = specter.SpecterEngine(model, specter.SpecterConfig(resident_experts_per_layer=4))
    out = engine.generate(ids, 64)
    assert all(state == "on" for state in out.stats["mechanisms"].values()), out.stats["mechanisms"]
    assert out.stats["residual_decodes"] > 0 and out.stats["draft_ahead_launches"] > 0
    assert out.token_ids == reference


@pytest.mark.parametrize("status,graph,compile_", [
    ("on, compiled", "on", "on"),
    ("on", "on", "off: "),  # compile not asked of the capture: says so below
    ("on, not compiled: BackendCompilerFailed: x", "on", "off: not compiled: BackendCompilerFailed: x"),
    ("failed: RuntimeError: capture", "off: RuntimeError: capture", "off: no CUDA graph to compile into (Runtime"),
    ("off", "off: no draft step captured", "off: no CUDA graph to compile into (no draft step"),
    ("off: eager (no static batch cache)", "off: eager (no static batch cache)", "off: no CUDA graph to compile")])
def test_a_mechanism_is_listed_as_run_only_where_the_draft_step_was_captured(status, graph, compile_):
    from experiments.records import mechanisms_ran
    asked = {"cuda_graph": "on", "draft_compile": "on", "draft_ahead": "on"}
    ran = as_run(asked, status)
    assert ran["cuda_graph"] == graph and ran["draft_compile"].startswith(compile_) and ran["draft_ahead"] == "on"
    listed = mechanisms_ran(ran).split()
    assert ("cuda_graph" in listed) == (graph == "on") and ("draft_compile" in listed) == (compile_ == "on")


def test_an_engine_whose_graph_was_asked_but_not_captured_does_not_list_it(monkeypatch):
    """As if CUDA graphs could run here: the CPU captures nothing, so the stats must not list them as run."""
    import specter.mechanisms
    monkeypatch.setattr(specter.mechanisms, "graph_state", lambda config, device: "on")
    engine = specter.SpecterEngine(specter.load_model("tiny-phi", device="cpu"), specter.SpecterConfig(k=3))
    assert engine.mechanisms["cuda_graph"] == engine.mechanisms["draft_compile"] == "on"  # asked and resolved
    ran = engine.generate(prompt(), 8).stats["mechanisms"]
    assert ran["cuda_graph"] == "off: no draft step captured"
    assert ran["draft_compile"].startswith("off: no CUDA graph to compile into")
