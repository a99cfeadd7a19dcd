"""llama.cpp baseline: the target converted to GGUF, decoded greedily through llama-cpp-python."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from baselines.gguf_convert import (
    SETUP_HINT,
    convert,
    converter_root,
    gguf_outtype,
    prepare_checkpoint,
    source_dir,
    unconvertible,
)
from baselines.worker_process import WorkerProcess
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.inputs import check_prompt
from specter.metrics import GenerationResult, tpot_ms
from specter.models.hybrid import HybridMoEModel
from specter.device.budget import kv_bytes_per_token, plan_memory

INSTALL_HINT = ('pip install -e ".[llamacpp]" (portable CPU build: CMAKE_ARGS=-DGGML_NATIVE=off; '
                'NVIDIA GPU: CMAKE_ARGS=-DGGML_CUDA=on), or scripts/setup_llamacpp.sh')
GGUF_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
WORKER = Path(__file__).parent / "workers" / "llama_cpp_worker.py"
STARTUP_TIMEOUT_S, LOAD_TIMEOUT_S, TOKEN_TIMEOUT_S = 120.0, 900.0, 10.0


def llama_cpp_missing() -> str:
    """Why llama-cpp-python is not installed here, or "" (whether it loads is the worker's to say)."""
    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # in sys.modules without a spec: an importable stand-in
        found = True
    return "" if found else f"llama-cpp-python is not importable (not installed); install: {INSTALL_HINT}"


def gpu_layers_that_fit(budget_bytes: int, reserved_bytes: int, layer_bytes: list[int]) -> int:
    """How many of llama.cpp's offloadable layers (in its offload order) fit in the budget after `reserved`.

    llama.cpp offloads layers in a fixed order and only whole layers, so the count stops at the first
    one that does not fit.
    """
    free, count = budget_bytes - reserved_bytes, 0
    for size in layer_bytes:
        if size > free:
            break
        free, count = free - size, count + 1
    return count


def offload_order_bytes(config: transformers.PretrainedConfig, element_size: int, n_ctx: int) -> list[int]:
    """Bytes of each offloadable layer in llama.cpp's order: n_gpu_layers=n puts the output head (final
    norm + lm_head) and the last n-1 decoder layers on the GPU; a decoder layer brings its KV for n_ctx."""
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    decoder = hf.model.layers
    kv = kv_bytes_per_token(config, element_size) // config.num_hidden_layers * n_ctx  # MLA: the latent
    layers = [sum(p.numel() for p in layer.parameters()) * element_size + kv for layer in decoder]
    head = sum(p.numel() for p in [*hf.model.norm.parameters(), *hf.lm_head.parameters()]) * element_size
    return [head, *reversed(layers)]


class LlamaCppBaseline:
    """Greedy autoregressive decoding of the target in llama.cpp, from a GGUF converted once per object.

    The GGUF is written by llama.cpp's own convert_hf_to_gguf.py from a checkpoint of the exact target
    weights (baselines.export), in the model's dtype (f32 on CPU), and lives in a temporary directory
    owned by this object. n_gpu_layers comes from the GPU bytes Specter uses with the same expert slots
    (0 without a GPU build or device). llama.cpp runs in a worker process of its own
    (baselines/workers/llama_cpp_worker.py): a CUDA build crashes in a process where torch has used CUDA.
    """

    name = "llama_cpp"

    def __init__(self, model: HybridMoEModel, resident_experts_per_layer: int | None = None,
                 n_threads: int | None = None) -> None:
        self.model = model
        self.config = model.hf.config
        self.slots = resident_experts_per_layer or model.spec.num_experts
        self.outtype = gguf_outtype(self.config, model.dtype, model.device)
        self.n_threads = n_threads or torch.get_num_threads()
        self._status: tuple[bool, str] | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._gguf: Path | None = None
        self._worker: WorkerProcess | None = None
        self._n_ctx = 0
        self.n_gpu_layers = 0
        self.convert_s = float("nan")

    def available(self) -> tuple[bool, str]:
        if self._status is None:
            reason = self._unavailable_reason()
            self._status = (not reason, reason)
        return self._status

    def _unavailable_reason(self) -> str:
        if reason := llama_cpp_missing():
            return reason
        if reason := unconvertible(self.config):
            return reason
        if converter_root() is None:
            return f"llama.cpp's converter (from the llama-cpp-python sdist) is not under {source_dir()}: {SETUP_HINT}"
        try:
            self.worker()
        except SpecterError as exc:
            return f"llama-cpp-python does not load: {exc}; install: {INSTALL_HINT}"
        return ""

    def worker(self) -> WorkerProcess:
        """The llama.cpp worker process (started on first use; its hello says the version and GPU support)."""
        if self._worker is None:
            self._worker = WorkerProcess([sys.executable, str(WORKER)], "llama.cpp worker", STARTUP_TIMEOUT_S)
        return self._worker

    def gguf_path(self) -> Path:
        """The converted model (converted on first use; the HF checkpoint written for it is removed)."""
        if self._gguf is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="specter-gguf-")
            work = Path(self._tmp.name)
            start = time.perf_counter()
            checkpoint = prepare_checkpoint(self.model, work / "hf")
            self._gguf = convert(checkpoint, work / f"model-{self.outtype}.gguf", self.outtype)
            self.convert_s = time.perf_counter() - start
            for path in sorted(checkpoint.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            checkpoint.rmdir()
        return self._gguf

    def plan_gpu_layers(self, n_ctx: int) -> int:
        """n_gpu_layers for Specter's GPU bytes at the same slot count; 0 on CPU or without GPU offload."""
        if self.model.device.type != "cuda" or not self.worker().hello["gpu_offload"]:
            return 0
        plan = plan_memory(self.model.spec, self.config, dtype=self.model.dtype)
        order = offload_order_bytes(self.config, GGUF_BYTES[self.outtype], n_ctx)
        return gpu_layers_that_fit(plan.bytes_for(self.slots), plan.workspace_bytes, order)

    def _load(self, needed_ctx: int) -> None:
        """Load the GGUF in the worker, again when a request needs more positions than the context has."""
        if needed_ctx <= self._n_ctx:
            return
        n_ctx = max(512, -(-needed_ctx // 256) * 256)
        self.n_gpu_layers = self.plan_gpu_layers(n_ctx)
        self.worker().request({"op": "load", "gguf": str(self.gguf_path()), "n_ctx": n_ctx,
                               "n_gpu_layers": self.n_gpu_layers, "n_threads": self.n_threads,
                               "kv_f32": self.outtype == "f32"}, LOAD_TIMEOUT_S)
        self._n_ctx = n_ctx

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult:
        """Exactly max_new_tokens greedy tokens (no EOS stop), each timestamped in the worker as llama.cpp
        yields it."""
        prompt = check_prompt(input_ids, max_new_tokens, self.model.vocab_size, self.model.max_positions)[0].tolist()
        ok, reason = self.available()
        if not ok:
            raise SpecterError(f"the llama.cpp baseline cannot run here: {reason}")
        self._load(len(prompt) + max_new_tokens)
        out = self.worker().request({"op": "generate", "prompt": prompt, "max_new_tokens": max_new_tokens},
                                    LOAD_TIMEOUT_S + TOKEN_TIMEOUT_S * max_new_tokens)
        return GenerationResult(out["token_ids"], self._stats(out["times_ms"]))

    def _stats(self, times: list[float]) -> dict:
        return {"generated_tokens": len(times), "tpot_ms": tpot_ms(times), "ttft_ms": times[0],
                "e2e_ms": times[-1], "n_gpu_layers": self.n_gpu_layers,
                "gguf_dtype": self.outtype, "convert_s": self.convert_s, "n_threads": self.n_threads}

    def close_context(self) -> None:
        """Stop the worker (and with it the llama.cpp context)."""
        if self._worker is not None:
            self._worker.close()
            self._worker, self._n_ctx, self._status = None, 0, None

    def close(self) -> None:
        """Free the llama.cpp context and delete the GGUF."""
        self.close_context()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self._gguf = None, None

    def __del__(self) -> None:
        with contextlib.suppress(TypeError, AttributeError, ImportError):  # at exit llama_cpp may be torn down
            self.close()


def make_llama_cpp(model: HybridMoEModel, specter_config: SpecterConfig) -> LlamaCppBaseline:
    """The llama.cpp baseline with the run's expert slots (its GPU budget is Specter's at those slots)."""
    return LlamaCppBaseline(model, specter_config.resident_experts_per_layer)
