"""The vLLM baseline's worker: runs inside the vLLM virtual environment (stdlib, torch, vllm only; no specter).

Protocol (baselines/vllm_engine.py speaks it, through baselines/worker_process.py; the loop is worker_loop.py):
one JSON object per line on stdin, one reply per line on stdout.
  {"op": "hello"}                       -> vllm/torch versions, platform, supported architectures, MLA sizes
  {"op": "load", "checkpoint", "dtype", "cpu_offload_gb", "max_model_len", "gpu_memory_gb"} -> load_s
  {"op": "generate", "prompts": [[ids]], "max_new_tokens"} -> per prompt token_ids and times_ms
  {"op": "close"}                       -> exits (so does end of input)
Every reply has "ok"; a failure is {"ok": false, "error": "<one line>"}.
One-shot use: `python vllm_worker.py REQUEST.json` with the load and generate fields in one object prints
the hello, load and generate replies merged into one JSON object.
"""
from __future__ import annotations

import json
import os
import sys
import time

from worker_loop import handle, replies_to_stdout, serve  # a sibling file: the worker runs as a script

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; otherwise the CPU backend takes most of the RAM


def hello(_request: dict) -> dict:
    import torch
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    return {"vllm": vllm.__version__, "torch": torch.__version__, "platform": current_platform.device_type,
            "architectures": sorted(ModelRegistry.get_supported_archs()), "mla_head_sizes": mla_head_sizes()}


def mla_head_sizes() -> list[int] | None:
    """Latent + rope head sizes vLLM's MLA attention (DeepSeek-V2) accepts, where this version says."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
        return list(MLACommonBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return None


class Worker:
    """Holds one loaded vllm.LLM and serves requests against it."""

    def __init__(self) -> None:
        self.llm = None
        self.next_id = 0

    def load(self, request: dict) -> dict:
        import vllm
        kwargs = {"model": request["checkpoint"], "dtype": request.get("dtype", "auto"), "enforce_eager": True,
                  "max_model_len": int(request.get("max_model_len", 256)), "skip_tokenizer_init": True,
                  "cpu_offload_gb": float(request.get("cpu_offload_gb", 0.0)), "seed": 0}
        if request.get("gpu_memory_gb"):
            kwargs["gpu_memory_utilization"] = gpu_fraction(float(request["gpu_memory_gb"]))
        start = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        return {"load_s": time.perf_counter() - start, "llm_kwargs": kwargs}

    def generate(self, request: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("no model loaded (send a load request first)")
        return {"results": [self.generate_one(ids, int(request["max_new_tokens"])) for ids in request["prompts"]]}

    def generate_one(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """Greedy decoding through the engine's step loop; each new token is timestamped when it comes out."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.CUMULATIVE)
        engine = self.llm.llm_engine
        request_id = f"specter-{self.next_id}"
        self.next_id += 1
        tokens: list[int] = []
        times_ms: list[float] = []
        start = time.perf_counter()
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                now_ms = (time.perf_counter() - start) * 1e3
                new = list(output.outputs[0].token_ids)[len(tokens):]
                tokens.extend(new)
                times_ms.extend([now_ms] * len(new))  # tokens that come out together share their time
        return {"token_ids": tokens, "times_ms": times_ms}


def gpu_fraction(budget_gb: float) -> float:
    """vLLM's gpu_memory_utilization for a budget in GiB (CUDA only)."""
    import torch
    total = torch.cuda.get_device_properties(0).total_memory / 1024**3
    return max(0.05, min(0.95, budget_gb / total))


def operations(worker: Worker) -> dict:
    return {"hello": hello, "load": worker.load, "generate": worker.generate}


def one_shot(path: str, reply) -> int:
    with open(path) as f:
        request = json.load(f)
    ops, merged = operations(Worker()), {}
    for op in ("hello", "load", "generate"):
        merged.update(handle(ops, {**request, "op": op}))
        if not merged["ok"]:
            break
    reply.write(json.dumps(merged) + "\n")
    return 0 if merged["ok"] else 1


def main(argv: list[str]) -> int:
    with replies_to_stdout() as reply:  # anything vLLM and its engine processes print goes to stderr
        if argv:
            return one_shot(argv[0], reply)
        serve(operations(Worker()), reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
