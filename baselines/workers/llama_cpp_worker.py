"""The llama.cpp baseline's worker: llama-cpp-python in a process of its own, without torch.

A CUDA build of llama.cpp crashes (SIGSEGV) in a process where torch has already used CUDA (measured on
the H200: torch 2.11+cu130 and llama.cpp 0.3.36 built with CUDA 13.0; the same model decodes in a
process alone), so the adapter (baselines/llama_cpp.py) never loads a model in its own process.
Protocol (through baselines/worker_process.py; the loop is worker_loop.py), one JSON object per line:
  {"op": "hello"}                                   -> version, gpu_offload
  {"op": "load", "gguf", "n_ctx", "n_gpu_layers", "n_threads", "kv_f32"} -> load_s
  {"op": "generate", "prompt": [ids], "max_new_tokens"} -> token_ids, times_ms (since the call began)
  {"op": "close"}                                   -> exits (so does end of input)
"""
from __future__ import annotations

import sys
import time

from worker_loop import replies_to_stdout, serve  # a sibling file: the worker runs as a script


def hello(_request: dict) -> dict:
    import llama_cpp
    return {"version": llama_cpp.__version__, "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


class Worker:
    """Holds one llama.cpp context."""

    def __init__(self) -> None:
        self.llm = None

    def load(self, request: dict) -> dict:
        import llama_cpp
        self.close()
        n_ctx = int(request["n_ctx"])
        kv_type = llama_cpp.GGML_TYPE_F32 if request.get("kv_f32") else llama_cpp.GGML_TYPE_F16
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(request["gguf"], n_ctx=n_ctx, n_batch=min(512, n_ctx),
                                   n_gpu_layers=int(request["n_gpu_layers"]), n_threads=int(request["n_threads"]),
                                   n_threads_batch=int(request["n_threads"]), type_k=kv_type, type_v=kv_type,
                                   seed=0, verbose=False)
        return {"load_s": time.perf_counter() - start}

    def generate(self, request: dict) -> dict:
        """Exactly max_new_tokens greedy tokens (no EOS stop), each timestamped as llama.cpp yields it."""
        if self.llm is None:
            raise RuntimeError("no model loaded (send a load request first)")
        max_new_tokens = int(request["max_new_tokens"])
        self.llm.reset()  # no KV reuse from the previous request
        tokens, times_ms = [], []
        start = time.perf_counter()
        stream = self.llm.generate(list(request["prompt"]), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in stream:
            times_ms.append((time.perf_counter() - start) * 1e3)
            tokens.append(int(token))
            if len(tokens) == max_new_tokens:
                break
        stream.close()
        return {"token_ids": tokens, "times_ms": times_ms}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def main() -> int:
    worker = Worker()
    with replies_to_stdout() as reply:  # llama.cpp's own prints go to stderr
        serve({"hello": hello, "load": worker.load, "generate": worker.generate}, reply)
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
