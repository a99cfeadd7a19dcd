"""The shared-instance hybrid model: one set of non-expert tensors, INT4 draft experts, FP target experts."""
import pytest
import torch
from transformers import DynamicCache

from specter.kernels.reference import expert_wise_moe, token_wise_moe
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import DRAFT, TARGET, HybridExperts, draft_kernel
from specter.quant.int4 import dequantize
from tests.conftest import pristine_hf, prompt, tiny_model


def test_non_expert_tensors_are_shared_between_modes(tiny_name):
    model = tiny_model(tiny_name)
    draft, target = model.mode_tensors(DRAFT), model.mode_tensors(TARGET)
    shared = model.shared_tensors()
    assert shared, "a model has embeddings, attention and norms"
    assert any("embed" in n for n in shared) and any("attn" in n for n in shared)
    for name in shared:
        assert draft[name].data_ptr() == target[name].data_ptr(), name
    draft_experts = {t.data_ptr() for n, t in draft.items() if n not in shared}
    target_experts = {t.data_ptr() for n, t in target.items() if n not in shared}
    assert draft_experts and target_experts and not draft_experts & target_experts


def test_no_tensor_is_duplicated(tiny_name):
    """The hybrid model holds exactly the HF model's parameters plus the packed INT4 experts."""
    model = tiny_model(tiny_name)
    assert sum(p.numel() for p in model.hf.parameters()) == sum(p.numel() for p in pristine_hf(tiny_name).parameters())
    ptrs = [p.data_ptr() for p in model.hf.parameters()]
    assert len(ptrs) == len(set(ptrs))


def test_every_hf_experts_module_is_replaced(tiny_name):
    model = tiny_model(tiny_name)
    swapped = [m for m in model.hf.modules() if isinstance(m, HybridExperts)]
    originals = [m for m in model.hf.modules() if type(m).__name__.endswith("Experts") and not isinstance(m, HybridExperts)]
    assert swapped == model.experts and not originals
    assert model.num_moe_layers == len(swapped) >= 2


def test_draft_mode_runs_the_int4_experts(tiny_name):
    """Draft logits equal a target forward whose FP experts were replaced by the dequantized INT4 weights."""
    model = tiny_model(tiny_name)
    ids = prompt()
    draft = model.forward(ids, DynamicCache(config=model.hf.config), DRAFT)
    target = model.forward(ids, DynamicCache(config=model.hf.config), TARGET)
    assert not torch.allclose(draft, target, atol=1e-4)
    saved = [(m.gate_up_proj.data.clone(), m.down_proj.data.clone()) for m in model.experts]
    try:
        for m in model.experts:
            m.gate_up_proj.data.copy_(dequantize(m.draft_gate_up))
            m.down_proj.data.copy_(dequantize(m.draft_down))
        dequantized_target = model.forward(ids, DynamicCache(config=model.hf.config), TARGET)
    finally:
        for m, (gu, d) in zip(model.experts, saved):
            m.gate_up_proj.data.copy_(gu)
            m.down_proj.data.copy_(d)
    torch.testing.assert_close(draft, dequantized_target, atol=1e-5, rtol=1e-5)


def test_mode_context_restores_previous_mode():
    model = tiny_model("tiny")
    with model.mode(DRAFT):
        assert all(m.mode == DRAFT for m in model.experts)
    assert all(m.mode == TARGET for m in model.experts)
    with pytest.raises(ValueError):
        with model.mode("fp8"):
            pass


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 2), (16, 3)])
def test_expert_wise_equals_token_wise(tokens, top_k):
    torch.manual_seed(tokens)
    experts, hidden, inter = 6, 32, 16
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x = torch.randn(tokens, hidden)
    idx = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])  # [T, k]
    w = torch.rand(tokens, top_k)

    def weights_of(e):
        return gate_up[e], down[e]

    act = torch.nn.functional.silu
    torch.testing.assert_close(expert_wise_moe(x, idx, w, weights_of, experts, act),
                               token_wise_moe(x, idx, w, weights_of, act), atol=1e-4, rtol=1e-4)


def test_hybrid_model_is_a_plain_dataclass_wrapper():
    model = tiny_model("tiny")
    assert isinstance(model, HybridMoEModel)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.top_k == 2 and model.num_experts == 8


@pytest.mark.parametrize("cuda,pairs,limit,expected", [(True, 6, 48, "decode"), (True, 48, 48, "decode"),
                                                        (True, 49, 48, "tiled"), (True, 1, 0, "tiled"),
                                                        (False, 6, 48, "reference")])
def test_draft_kernel_by_routed_pairs(cuda, pairs, limit, expected):
    assert draft_kernel(cuda, pairs, limit) == expected
