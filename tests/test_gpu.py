"""CUDA checks (run on the H200 through the device tool; skipped on CPU)."""
import pytest
import torch

import specter
from baselines.target_only import TargetOnly
from tests.conftest import prompt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen", "tiny-phi", "tiny-mixtral"])
def test_fp16_greedy_equals_target_only_on_cuda(name):
    model = specter.load_model(name, device="cuda", dtype=torch.float16)
    assert model.device.type == "cuda" and model.dtype == torch.float16
    ids = prompt()
    reference = TargetOnly(model).generate(ids, 32).token_ids
    for k in (1, 4, 16):
        out = specter.SpecterEngine(model, specter.SpecterConfig(k=k)).generate(ids, 32)
        assert out.token_ids == reference, (name, k)
        assert out.stats["tpot_ms"] > 0


def test_sampling_runs_on_cuda():
    model = specter.load_model("tiny", device="cuda", dtype=torch.float16)
    out = specter.SpecterEngine(model, specter.SpecterConfig(k=4, temperature=0.8)).generate(prompt(), 16)
    assert len(out.token_ids) == 16
