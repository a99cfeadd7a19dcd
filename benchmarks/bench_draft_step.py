"""The draft step as the default runs it (compiled CUDA graph) beside the eager step and the plain graph, per model.

    python benchmarks/bench_draft_step.py --models dsv2 phi --layers phi=16 --out DIR

Synthetic weights (bf16, the default on CUDA; the draft reads only the INT4 experts, so the FP experts stay in
the host store), one process, one static cache per model prefilled with PROMPT_TOKENS. For each model: the
eager step, the plain captured step and the compiled captured step (SpecterConfig.draft_compile), median of
--reps, timed with CUDA events from the host's first launch to the last kernel; how many of the plain and the
compiled graph's CHAIN chained tokens agree with the eager chain's (a replay may round differently, e.g. where
cuBLAS picks another algorithm inside a capture: near-ties of random logits flip); the eager / default ratio.
Prints a table and writes draft_step.csv. `--position` starts chains there too (e.g. past phi's longrope switch).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specter  # noqa: E402
from benchmarks.bench_kernel import median_ms  # noqa: E402
from specter.draft.graph import DraftStepGraph, rollback  # noqa: E402
from specter.hooks import attributes_set  # noqa: E402
from specter.kernels.moe_align import MoEWorkspace  # noqa: E402
from specter.metrics import write_rows_csv  # noqa: E402
from specter.models.device_rope import rope_switch  # noqa: E402
from specter.models.hybrid_experts import DRAFT  # noqa: E402
from specter.prefetch.lookahead import ExpertLookaheadBuffer  # noqa: E402
from specter.speculative.state import new_static_cache  # noqa: E402

PROMPT_TOKENS = 16
CHAIN = 8


def prompt_cache(model, prompt: torch.Tensor, length: int):
    """A static cache holding the draft's KV of `prompt` [1, T] (the FP experts are on the host)."""
    cache = new_static_cache(model, length)
    model.forward(prompt, cache, DRAFT)
    return cache


def chain(step, token: torch.Tensor, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = step(token)
        out.append(int(token.reshape(-1)[0]))
    return out


def measure(model, name: str, position: int, reps: int) -> dict:
    """One model's row: eager, plain graph and compiled graph step times and their tokens."""
    elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
    length = position + CHAIN + 64
    prompt = torch.randint(0, 256, (1, position), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    caches = [prompt_cache(model, prompt, length) for _ in range(3)]  # eager, plain, compiled: the same KV
    token = torch.tensor([[65]], device="cuda")

    def eager(t):
        with model.observe_draft_routing(elb.observe):
            return model.forward(t.view(1, 1), caches[0], DRAFT)[:, -1].argmax(dim=-1, keepdim=True)

    plain = DraftStepGraph(model, caches[1], elb, position)
    started = time.perf_counter()
    compiled = DraftStepGraph(model, caches[2], elb, position, compiled=True)
    compile_s = time.perf_counter() - started
    eager_tokens = chain(eager, token, CHAIN)
    rollback(caches[0], elb, position)
    plain_tokens, compiled_tokens = chain(plain.step, token, CHAIN), chain(compiled.step, token, CHAIN)
    for graph in (plain, compiled):
        rollback(graph.cache, elb, position)
    eager_ms = median_ms(lambda: (eager(token), rollback(caches[0], elb, position)), 0, reps, cuda=True)
    plain_ms = median_ms(lambda: plain.step(token), 0, reps, cuda=True)
    compiled_ms = median_ms(lambda: compiled.step(token), 0, reps, cuda=True)
    return {"model": name, "layers": model.hf.config.num_hidden_layers, "position": position,
            "longrope": "yes" if rope_switch(model.hf.config) else "no",
            "eager_ms": round(eager_ms, 3), "graph_ms": round(plain_ms, 3), "default_ms": round(compiled_ms, 3),
            "eager_over_default": round(eager_ms / compiled_ms, 2),
            "graph_agree": f"{sum(a == b for a, b in zip(plain_tokens, eager_tokens))}/{CHAIN}",
            "compiled_agree": f"{sum(a == b for a, b in zip(compiled_tokens, eager_tokens))}/{CHAIN}",
            "compile_s": round(compile_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dsv2", "phi"])
    parser.add_argument("--layers", nargs="*", default=[], help="name=N: build that model with N decoder layers")
    parser.add_argument("--position", nargs="*", default=[],
                        help="name=P[,P...]: a row per position P where the chain starts (default 16)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_draft_step.py needs a CUDA GPU")
    layers = dict(item.split("=") for item in args.layers)
    positions = dict(item.split("=") for item in args.position)
    rows = []
    for name in args.models:
        model = specter.load_model(name, synthetic=True, device="cuda", experts_on_host=True,
                                   num_layers=int(layers[name]) if name in layers else None)
        if model.rope_on_host:
            sys.exit(f"error: {name}'s rotary picks its regime on the host ({model.rope_on_host}): no graph to time")
        for position in str(positions.get(name, PROMPT_TOKENS)).split(","):
            with torch.inference_mode(), attributes_set(model.experts, draft_workspace=MoEWorkspace()):
                rows.append(measure(model, name, int(position), args.reps))
            print(" | ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
        del model
        torch.cuda.empty_cache()
    write_rows_csv(args.out / "draft_step.csv", rows)
    print("\nmodel   layers  position  eager ms  graph ms  default ms  eager/default  graph agrees  compiled agrees")
    for r in rows:
        print(f"{r['model']:7s} {r['layers']:6d} {r['position']:9d} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} "
              f"{r['default_ms']:11.3f} {r['eager_over_default']:14.2f}  {r['graph_agree']:12s}  {r['compiled_agree']}")


if __name__ == "__main__":
    main()
