"""The memory check before a build: one line naming the need and the ways out, before anything is allocated."""
import pytest
import torch

from specter.errors import SpecterError
from specter.models.loading import hf_config
from specter.models.memory_check import GB, build_need, check_build_memory
from specter.models.registry import get_spec


def test_full_size_dsv2_on_the_cpu_needs_its_float32_weights_in_host_ram():
    spec = get_spec("dsv2")
    need = build_need(spec, hf_config(spec), torch.device("cpu"), torch.float32, experts_on_host=False)
    assert 60 * GB < need.host < 90 * GB and need.gpu == 0  # 15.7B parameters x 4 bytes, plus the draft
    with pytest.raises(SpecterError) as error:
        check_build_memory(spec, hf_config(spec), torch.device("cpu"), torch.float32, False, host_free=24 * GB)
    message = str(error.value)
    assert "\n" not in message and message.startswith("building dsv2 (27 layers, float32) on cpu needs about")
    assert "24.0 GB is available" in message and "model.layers=N" in message and "experts_on_host" in message


def test_experts_on_host_split_the_need_between_host_and_gpu():
    spec = get_spec("dsv2")
    cuda = torch.device("cuda")
    split = build_need(spec, hf_config(spec), cuda, torch.bfloat16, experts_on_host=True)
    whole = build_need(spec, hf_config(spec), cuda, torch.bfloat16, experts_on_host=False)
    assert split.host > 25 * GB and split.gpu < 15 * GB and whole.host == 0  # the INT4 draft is on the GPU
    assert abs(split.host + split.gpu - whole.gpu) < GB
    with pytest.raises(SpecterError, match="needs about .* GB of GPU memory, but 1.0 GB is free"):
        check_build_memory(spec, hf_config(spec), cuda, torch.bfloat16, True, host_free=100 * GB, gpu_free=GB)
    check_build_memory(spec, hf_config(spec), cuda, torch.bfloat16, True, host_free=100 * GB, gpu_free=80 * GB)


def test_the_check_can_be_skipped_and_lets_small_builds_through(monkeypatch):
    spec = get_spec("dsv2")
    monkeypatch.setenv("SPECTER_SKIP_MEMORY_CHECK", "1")
    check_build_memory(spec, hf_config(spec), torch.device("cpu"), torch.float32, False, host_free=GB)
    monkeypatch.delenv("SPECTER_SKIP_MEMORY_CHECK")
    tiny = get_spec("tiny")
    check_build_memory(tiny, hf_config(tiny), torch.device("cpu"), torch.float32, False, host_free=GB)
