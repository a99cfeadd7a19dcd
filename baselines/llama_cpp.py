"""llama.cpp baseline: the target converted to GGUF, decoded greedily through llama-cpp-python."""
from __future__ import annotations

import contextlib
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
from specter.config import SpecterConfig
from specter.inputs import check_prompt
from specter.metrics import GenerationResult, tpot_ms
from specter.models.hybrid import HybridMoEModel
from specter.offload.budget import kv_bytes_per_token, plan_memory

INSTALL_HINT = ('pip install -e ".[llamacpp]" (portable CPU build: CMAKE_ARGS=-DGGML_NATIVE=off; '
                'NVIDIA GPU: CMAKE_ARGS=-DGGML_CUDA=on), or scripts/setup_llamacpp.sh')
GGUF_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def import_llama_cpp():
    """(the llama_cpp module, "") or (None, why it cannot be imported and how to install it)."""
    try:
        import llama_cpp
    except (ImportError, OSError) as err:  # OSError: the shared library does not load
        return None, f"llama-cpp-python is not importable ({type(err).__name__}: {err}); install: {INSTALL_HINT}"
    return llama_cpp, ""


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
    (0 without a GPU build or device).
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
        self._llm = None
        self._n_ctx = 0
        self.n_gpu_layers = 0
        self.convert_s = float("nan")

    def available(self) -> tuple[bool, str]:
        if self._status is None:
            reason = self._unavailable_reason()
            self._status = (not reason, reason)
        return self._status

    def _unavailable_reason(self) -> str:
        llama_cpp, reason = import_llama_cpp()
        if llama_cpp is None:
            return reason
        if reason := unconvertible(self.config):
            return reason
        if converter_root() is None:
            return f"llama.cpp's converter (from the llama-cpp-python sdist) is not under {source_dir()}: {SETUP_HINT}"
        return ""

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
        llama_cpp, _ = import_llama_cpp()
        if self.model.device.type != "cuda" or llama_cpp is None or not llama_cpp.llama_supports_gpu_offload():
            return 0
        plan = plan_memory(self.model.spec, self.config, dtype=self.model.dtype)
        order = offload_order_bytes(self.config, GGUF_BYTES[self.outtype], n_ctx)
        return gpu_layers_that_fit(plan.bytes_for(self.slots), plan.workspace_bytes, order)

    def _llama(self, needed_ctx: int):
        """The llama.cpp context, (re)built when a request needs more positions than it has."""
        if self._llm is not None and needed_ctx <= self._n_ctx:
            return self._llm
        import llama_cpp

        self.close_context()
        n_ctx = max(512, -(-needed_ctx // 256) * 256)
        self.n_gpu_layers = self.plan_gpu_layers(n_ctx)
        kv_type = llama_cpp.GGML_TYPE_F32 if self.outtype == "f32" else llama_cpp.GGML_TYPE_F16
        self._llm = llama_cpp.Llama(str(self.gguf_path()), n_ctx=n_ctx, n_batch=min(512, n_ctx),
                                    n_gpu_layers=self.n_gpu_layers, n_threads=self.n_threads,
                                    n_threads_batch=self.n_threads, type_k=kv_type, type_v=kv_type,
                                    seed=0, verbose=False)
        self._n_ctx = n_ctx
        return self._llm

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult:
        """Exactly max_new_tokens greedy tokens (no EOS stop), each timestamped as llama.cpp yields it."""
        prompt = check_prompt(input_ids, max_new_tokens)[0].tolist()
        llm = self._llama(len(prompt) + max_new_tokens)
        llm.reset()  # no KV reuse from the previous request
        tokens, times = [], []
        start = time.perf_counter()
        stream = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in stream:
            times.append((time.perf_counter() - start) * 1e3)
            tokens.append(int(token))
            if len(tokens) == max_new_tokens:
                break
        stream.close()
        return GenerationResult(tokens, self._stats(times))

    def _stats(self, times: list[float]) -> dict:
        return {"generated_tokens": len(times), "tpot_ms": tpot_ms(times), "ttft_ms": times[0],
                "e2e_ms": times[-1], "n_gpu_layers": self.n_gpu_layers,
                "gguf_dtype": self.outtype, "convert_s": self.convert_s, "n_threads": self.n_threads}

    def close_context(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm, self._n_ctx = None, 0

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
