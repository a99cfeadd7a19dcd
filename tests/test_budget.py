"""GPU memory budgets: GB -> expert slots, and a clear error when the fixed part does not fit."""
import pytest
import torch

from specter.errors import SpecterError
from specter.models.loading import hf_config
from specter.models.registry import get_spec
from specter.device.budget import GB, plan_memory


def test_dsv2_plan_matches_the_architecture():
    plan = plan_memory(get_spec("dsv2"), hf_config(get_spec("dsv2")), torch.float16)
    assert plan.expert_bytes == 3 * 1408 * 2048 * 2  # 17.3 MB, as in the design notes
    assert plan.num_moe_layers == 26 and plan.num_experts == 64
    assert 2 * GB < plan.non_expert_bytes < 3.5 * GB  # embeddings, lm_head, MLA, shared experts, dense layer
    assert plan.draft_bytes == pytest.approx(26 * 64 * plan.expert_bytes / 4 * (1 + 4 / 128), rel=1e-6)
    assert plan.kv_bytes == 27 * (512 + 64) * 2 * 4096


def test_budget_to_slots_and_back():
    plan = plan_memory(get_spec("qwen"), hf_config(get_spec("qwen")), torch.float16)
    for slots in (1, 8, 15):
        assert plan.slots_for(plan.bytes_for(slots) / GB) == slots
    assert plan.slots_for(1000) == 60  # never more slots than experts


def test_too_small_budget_says_how_much_is_needed():
    plan = plan_memory(get_spec("phi"), hf_config(get_spec("phi")), torch.float16)
    need = plan.bytes_for(1) / GB
    with pytest.raises(SpecterError, match=rf"too small: it needs at least {need:.2f} GB"):
        plan.slots_for(need - 0.1)
