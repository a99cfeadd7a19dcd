"""Shared fixtures: tiny synthetic models (float32, CPU) and their pristine HF twins."""
from __future__ import annotations

import functools
import os

import pytest
import torch

import specter
from specter.models.loading import build_synthetic
from specter.models.registry import TINY_MODELS, get_spec

# one thread per pytest-xdist worker (the README runs one worker per core), two in a plain run
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@functools.lru_cache(maxsize=None)
def tiny_model(name: str, seed: int = 0) -> specter.HybridMoEModel:
    return specter.load_model(name, device="cpu", dtype=torch.float32, seed=seed)


@functools.lru_cache(maxsize=None)
def pristine_hf(name: str, seed: int = 0):
    """The same seeded model without Specter's module swap: HF's own experts and generate()."""
    return build_synthetic(get_spec(name), torch.device("cpu"), torch.float32, seed)


def hf_greedy(name: str, input_ids: torch.Tensor, max_new_tokens: int, seed: int = 0) -> list[int]:
    model = pristine_hf(name, seed)
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=get_spec(name).hf_config["pad_token_id"])
    return out[0, input_ids.shape[1]:].tolist()


@pytest.fixture(scope="session", autouse=True)
def in_process_vllm_engine():
    """vLLM workers started by the tests run vLLM's engine core in their own process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): one vLLM import instead of two, half a worker's start-up on the CPU
    (24 s against 49 s for tiny-qwen). The baseline itself keeps vLLM's default."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
        yield


@pytest.fixture
def draft_ahead_on_cpu(monkeypatch):
    """Draft-ahead runs on the CPU too (in series: no side stream), so its logic is tested here; without this
    fixture it switches itself off without CUDA."""
    import specter.mechanisms
    monkeypatch.setattr(specter.mechanisms, "side_stream_problem", lambda device: "")


@pytest.fixture(params=TINY_MODELS)
def tiny_name(request) -> str:
    return request.param


def prompt(text: str = "Natalia sold clips to 48 of her friends") -> torch.Tensor:
    return torch.tensor([[256, *text.encode()]])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group marks
def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip cleanly where there is no CUDA device (CI, CPU machines). Under pytest-xdist
    (`--dist loadgroup`), the kernel files' interpreter-subprocess tests share one worker, so that their one
    interpreter run (`tests/triton_mode.py`, cached per process) is not repeated on every worker."""
    for item in items:
        if getattr(item, "originalname", None) == "test_interpreter_cases_in_subprocess":
            item.add_marker(pytest.mark.xdist_group("triton_interpreter"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
