"""Per-call hooks: a system leaves the shared model as it found it; models loaded one after the other share nothing."""
import gc

import pytest
import torch

import specter
from baselines.specmoeoff import SpecMoEOff, SpecMoEOffConfig
from baselines.target_only import TargetOnly
from specter.errors import SpecterError
from specter.hooks import attributes_set
from tests.conftest import hf_greedy, prompt

NEW = 16


def fresh(name: str, device: str = "cpu", dtype=torch.float32) -> specter.HybridMoEModel:
    return specter.load_model(name, device=device, dtype=dtype)


def hooks(model) -> list[tuple]:
    """What a call may change on the model: every layer's executor and draft workspace, the copy streams' grouping."""
    grouped = None if model.offload is None else model.offload.streams.group_copies
    return [(m.target_executor, m.draft_workspace, m.routing_observer) for m in model.experts] + [grouped]


def test_attributes_are_restored_after_the_block_and_after_an_error():
    objects = [type("Layer", (), {"executor": "own"})() for _ in range(3)]
    with pytest.raises(RuntimeError), attributes_set(objects, executor="installed"):
        assert [o.executor for o in objects] == ["installed"] * 3
        raise RuntimeError
    assert [o.executor for o in objects] == ["own"] * 3


def test_every_system_leaves_the_models_hooks_as_it_found_them():
    """Systems whose caches agree (the paper's design and the baselines: 2 slots, raw copies) share the model's
    runtime: none of their calls leaves a hook of its own behind."""
    model = fresh("tiny-qwen")
    paper = specter.SpecterEngine(model, specter.SpecterConfig.paper(k=4, resident_experts_per_layer=2))
    before = hooks(model)
    assert all(executor is model.offload.residency for executor, _, _ in before[:-1])
    systems = [paper, TargetOnly(model, 2), SpecMoEOff(model, SpecMoEOffConfig(slots=2, fixed_k=3))]
    for system in systems:
        system.generate(prompt(), 8)
        assert hooks(model) == before, system.name


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_default_engine_leaves_the_hooks_of_its_own_cache_as_it_found_them(temperature):
    """The default engine (pooled slots: a cache of its own, built with the engine) after a call, and after a
    batch refused for sampling."""
    model = fresh("tiny-qwen")
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=2,
                                                                temperature=temperature))
    assert engine.mechanisms["pooled_slots"] == "on"
    before = hooks(model)
    assert all(executor is model.offload.residency for executor, _, _ in before[:-1])
    engine.generate(prompt(), 8)
    assert hooks(model) == before
    if temperature:
        with pytest.raises(SpecterError, match="greedy only"):
            engine.generate([prompt()[0].tolist()] * 2, 4)
        assert hooks(model) == before


def test_engines_own_their_workspaces():
    model = fresh("tiny")
    a, b = (specter.SpecterEngine(model, specter.SpecterConfig(k=2, resident_experts_per_layer=2)) for _ in range(2))
    assert a.draft_workspace is not b.draft_workspace and a.verify_workspace is not b.verify_workspace
    assert all(m.draft_workspace is None for m in model.experts)  # installed only for the duration of a call


@pytest.mark.parametrize("names", [("tiny-qwen", "tiny-mixtral"), ("tiny", "tiny-phi")])
def test_two_models_loaded_one_after_the_other_both_decode_with_offload(names):
    for name in names:  # the first model and its engine are freed before the second loads
        model = fresh(name)
        engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
        assert engine.generate(prompt(), NEW).token_ids == hf_greedy(name, prompt(), NEW), name
        del model, engine
        gc.collect()


@pytest.mark.gpu
def test_two_models_loaded_one_after_the_other_decode_on_cuda_with_graphs():
    for name in ("tiny-qwen", "tiny"):
        model = fresh(name, "cuda", torch.float16)
        want = TargetOnly(model).generate(prompt(), 32).token_ids  # all experts resident
        engine = specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2))
        out = engine.generate(prompt(), 32)
        assert out.stats["draft_graph"].startswith("on") and out.token_ids == want, (name, out.stats["draft_graph"])
        del model, engine, out
        gc.collect()
        torch.cuda.empty_cache()


def test_a_draft_forward_binds_its_workspace_for_that_forward_only():
    """HybridMoEModel.forward(draft_workspace=...): every layer's draft kernels see the given workspace while
    the forward runs, and their own (None) afterwards; a target forward never binds it."""
    from specter.kernels.moe_align import MoEWorkspace
    from specter.models.hybrid_experts import DRAFT, TARGET
    from transformers import DynamicCache

    model = fresh("tiny")
    workspace, seen = MoEWorkspace(), []
    with model.observe_draft_routing(lambda layer, index: seen.append(model.experts[layer].draft_workspace)):
        model.forward(prompt(), DynamicCache(config=model.hf.config), DRAFT, draft_workspace=workspace)
    assert len(seen) == model.num_moe_layers and all(w is workspace for w in seen)
    assert [m.draft_workspace for m in model.experts] == [None] * model.num_moe_layers
    model.forward(prompt(), DynamicCache(config=model.hf.config), TARGET, draft_workspace=workspace)
    assert [m.draft_workspace for m in model.experts] == [None] * model.num_moe_layers
