"""The vLLM baseline: vllm.LLM with cpu_offload_gb sized from Specter's GPU budget, in its own environment."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from baselines.export import save_checkpoint
from baselines.worker_process import WorkerProcess
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.inputs import check_prompt
from specter.metrics import GenerationResult, tpot_ms
from specter.models.hybrid import HybridMoEModel
from specter.device.budget import GB, plan_memory

VLLM_VERSION = "0.32.0"
VLLM_MAX_MODEL_LEN = 2048  # positions vLLM plans its KV for (capped by the model's own)
WORKER = Path(__file__).parent / "workers" / "vllm_worker.py"
SETUP = "scripts/setup_vllm_env.sh"
# transformers 5 class names -> vLLM's registry names, where they differ (written into the checkpoint's config)
ARCH_ALIASES = {"PhimoeForCausalLM": "PhiMoEForCausalLM"}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def venv_dir() -> Path:
    return Path(os.environ.get("SPECTER_VLLM_VENV", "~/.cache/specter/vllm-venv")).expanduser()


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def gpu_install_hint() -> str:
    return (f"on a connected GPU machine: SPECTER_VLLM_PACKAGE=vllm=={VLLM_VERSION} {SETUP} "
            f"(i.e. pip install vllm=={VLLM_VERSION} in {venv_dir()})")


def cpu_offload_gb(weight_bytes: int, budget_bytes: int, kv_bytes: int, workspace_bytes: int) -> float:
    """GiB of weights vLLM keeps in host memory: weights - (budget - KV - workspace), at least 0."""
    return max(0.0, (weight_bytes - (budget_bytes - kv_bytes - workspace_bytes)) / GB)


def memory_sizing(model: HybridMoEModel, config: SpecterConfig) -> tuple[float, float]:
    """(cpu_offload_gb, budget GiB) for vLLM under the GPU budget Specter uses with the same slots."""
    plan = plan_memory(model.spec, model.hf.config, model.dtype)
    slots = config.resident_experts_per_layer or plan.num_experts
    budget = plan.bytes_for(slots)
    weights = plan.non_expert_bytes + plan.num_moe_layers * plan.num_experts * plan.expert_bytes
    return cpu_offload_gb(weights, budget, plan.kv_bytes, plan.workspace_bytes), budget / GB


def architecture(model: HybridMoEModel) -> str:
    """The architecture name vLLM knows the model by."""
    name = type(model.hf).__name__
    return ARCH_ALIASES.get(name, name)


def mla_check(config, hello: dict) -> tuple[bool, str] | None:
    """DeepSeek-V2's MLA head (kv_lora_rank + qk_rope_head_dim) against the sizes vLLM's MLA accepts."""
    sizes = hello.get("mla_head_sizes")
    if not getattr(config, "kv_lora_rank", None) or not sizes:
        return None
    head = config.kv_lora_rank + config.qk_rope_head_dim
    if head in sizes:
        return None
    return False, (f"vLLM {hello['vllm']} MLA attention supports head sizes {'/'.join(map(str, sizes))}, not "
                   f"{head} (kv_lora_rank {config.kv_lora_rank} + qk_rope_head_dim {config.qk_rope_head_dim})")


def _shutdown(state: dict) -> None:
    """Finalizer: close the worker and remove the exported checkpoint (at close() or interpreter exit)."""
    if state.get("worker") is not None:
        state.pop("worker").close()
    if state.get("tmp") is not None:
        shutil.rmtree(state.pop("tmp"), ignore_errors=True)


class VLLMBaseline:
    """vLLM (`vllm.LLM`, greedy, ignore_eos) on the target's exact weights, exported to a checkpoint directory.

    The GPU budget is Specter's for the same slots (plan_memory(...).bytes_for(slots)); what of the
    weights does not fit beside the KV cache and workspace is `cpu_offload_gb` (a no-op on CPU). TPOT comes
    from the time each token leaves vLLM's engine step loop. vLLM runs in the venv of
    scripts/setup_vllm_env.sh through one persistent worker process, started by the first available()
    (which also loads the model and decodes one token, so a model vLLM cannot run is an unavailable row,
    not a crash) and closed by close() or at exit. Worker replies are timed out; errors are one line.
    """

    name = "vllm"
    startup_timeout_s = 300.0
    load_timeout_s = 900.0
    token_timeout_s = 10.0

    def __init__(self, model: HybridMoEModel, config: SpecterConfig, checkpoint: str | None = None,
                 max_model_len: int | None = None) -> None:
        self.model = model
        self.offload_gb, self.budget_gb = memory_sizing(model, config)
        self.checkpoint = checkpoint
        positions = getattr(model.hf.config, "max_position_embeddings", None) or VLLM_MAX_MODEL_LEN
        self.max_model_len = max_model_len or min(VLLM_MAX_MODEL_LEN, positions)
        self.load_s: float | None = None
        self._availability: tuple[bool, str] | None = None
        self._state: dict = {}
        self._finalizer = weakref.finalize(self, _shutdown, self._state)

    def available(self) -> tuple[bool, str]:
        """Checked once: the venv, vLLM's platform and architectures, then a load and a one-token probe."""
        if self._availability is None:
            self._availability = self._check_environment() or self._check_model() or (True, "")
            if not self._availability[0]:
                _shutdown(self._state)
        return self._availability

    def _check_environment(self) -> tuple[bool, str] | None:
        cuda_hint = f"; {gpu_install_hint()}" if torch.cuda.is_available() else ""
        if not venv_python().is_file():
            return False, f"vLLM environment not found at {venv_dir()}; run {SETUP}{cuda_hint}"
        try:
            hello = self._worker().hello
        except SpecterError as exc:
            return False, f"{exc}{cuda_hint}"
        if hello["platform"] != self.model.device.type:
            return False, (f"vLLM {hello['vllm']} in {venv_dir()} runs on {hello['platform']} but the model is on "
                           f"{self.model.device.type}{cuda_hint}")
        if architecture(self.model) not in hello["architectures"]:
            return False, f"vLLM {hello['vllm']} does not support {architecture(self.model)}"
        return mla_check(self.model.hf.config, hello)

    def _check_model(self) -> tuple[bool, str] | None:
        try:
            self._load()
            self._generate([0], 1)
        except SpecterError as exc:
            return False, f"vLLM {self._worker().hello['vllm']} cannot run {architecture(self.model)} here: {exc}"
        return None

    def _worker(self) -> WorkerProcess:
        if self._state.get("worker") is None:
            env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
            self._state["worker"] = WorkerProcess([str(venv_python()), str(WORKER)], "vLLM worker",
                                                  self.startup_timeout_s, env)
        return self._state["worker"]

    def _load(self) -> None:
        """Export the checkpoint (unless one was given) and load it in the worker, once."""
        if self.load_s is not None:
            return
        checkpoint = self.checkpoint or self._export()
        reply = self._worker().request({
            "op": "load", "checkpoint": str(checkpoint), "dtype": DTYPE_NAMES.get(self.model.dtype, "auto"),
            "cpu_offload_gb": self.offload_gb, "max_model_len": self.max_model_len,
            "gpu_memory_gb": self.budget_gb if self.model.device.type == "cuda" else None}, self.load_timeout_s)
        self.load_s = reply["load_s"]

    def _export(self) -> Path:
        self._state["tmp"] = tempfile.mkdtemp(prefix="specter-vllm-ckpt-")
        directory = save_checkpoint(self.model, self._state["tmp"])
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config["architectures"] = [architecture(self.model)]
        config_path.write_text(json.dumps(config, indent=2))
        return directory

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult:
        ids = check_prompt(input_ids, max_new_tokens, self.model.vocab_size)[0].tolist()
        ok, reason = self.available()
        if not ok:
            raise SpecterError(f"the vLLM baseline cannot run here: {reason}")
        if len(ids) + max_new_tokens > self.max_model_len:
            raise SpecterError(f"prompt ({len(ids)}) + {max_new_tokens} new tokens exceed vLLM's max_model_len "
                               f"{self.max_model_len}")
        out = self._generate(ids, max_new_tokens)
        times = out["times_ms"]  # since the request was added, one per token as it left the engine's step loop
        stats = {"generated_tokens": len(out["token_ids"]), "tpot_ms": tpot_ms(times),
                 "ttft_ms": times[0] if times else float("nan"), "e2e_ms": times[-1] if times else float("nan"),
                 "load_s": self.load_s, "cpu_offload_gb": self.offload_gb, "budget_gb": self.budget_gb}
        return GenerationResult(out["token_ids"], stats)

    def _generate(self, ids: list[int], max_new_tokens: int) -> dict:
        reply = self._worker().request({"op": "generate", "prompts": [ids], "max_new_tokens": max_new_tokens},
                                       self.startup_timeout_s + self.token_timeout_s * max_new_tokens)
        return reply["results"][0]

    def close(self) -> None:
        """Stop the worker and remove the exported checkpoint (also done at interpreter exit)."""
        _shutdown(self._state)  # the finalizer stays armed for a worker started later
        self.load_s = None
        self._availability = None


def make_vllm(model: HybridMoEModel, specter_config: SpecterConfig, checkpoint: str | None = None) -> VLLMBaseline:
    return VLLMBaseline(model, specter_config, checkpoint)
