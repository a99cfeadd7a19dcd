"""Where the draft step's time goes (GPU): graph replay time, and the CUDA kernels of one step by total time.

    python benchmarks/profile_draft.py --model dsv2 --out DIR [--compile]

Synthetic full-size weights (bf16, the default on CUDA), experts resident (the draft reads only the INT4 experts). Prints
the replayed step's median time, then the top kernels of one eager step and of one replay, grouped by
name (torch.profiler), and writes profile.csv. With --compile it also captures the step compiled by
torch.compile (SpecterConfig.draft_compile) over its own static cache, checks whether both give the same
tokens for CHECK_STEPS chained steps and how often the compiled step agrees when fed the plain chain, and prints its compile time, replay time and the ratio to the plain
replay, and its kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specter  # noqa: E402
from specter.draft.graph import DraftStepGraph, rollback  # noqa: E402
from specter.hooks import attributes_set  # noqa: E402
from specter.kernels.moe_align import MoEWorkspace  # noqa: E402
from specter.metrics import write_rows_csv  # noqa: E402
from specter.models.hybrid_experts import DRAFT, TARGET  # noqa: E402
from specter.prefetch.lookahead import ExpertLookaheadBuffer  # noqa: E402
from specter.speculative.state import new_static_cache  # noqa: E402

PROMPT_TOKENS = 16
CHECK_STEPS = 8


def replay_ms(graph: DraftStepGraph, token: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.step(token)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(fn, label: str, top: int) -> list[dict]:
    """CUDA kernels run by fn(), grouped by name: calls and total ms, largest first."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += getattr(event, "device_time_total", 0.0) / 1e3  # us -> ms
    if not totals:  # a profiler build that does not list kernels as events: its own table
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top))
    rows = [{"run": label, "kernel": name[:90], "calls": n, "total_ms": round(ms, 4)}
            for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    all_ms = sum(r["total_ms"] for r in rows)
    print(f"\n{label}: {sum(r['calls'] for r in rows)} kernels, {all_ms:.3f} ms of kernel time")
    for r in rows[:top]:
        print(f"  {r['total_ms']:8.3f} ms  {r['calls']:5d}x  {r['kernel']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv2")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--compile", action="store_true", help="also time the torch.compile'd step (draft_compile)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: profile_draft.py needs a CUDA GPU")
    model = specter.load_model(args.model, synthetic=True, device="cuda")  # bfloat16, the default on CUDA
    # as the engine runs: inference tensors, and a draft workspace for the duration of the profile
    with torch.inference_mode(), attributes_set(model.experts, draft_workspace=MoEWorkspace()):
        profile(model, args)


def profile(model, args) -> None:
    """Replay time of the draft step, then the top kernels of an eager and a replayed step; profile.csv."""
    prompt = torch.randint(0, 256, (1, PROMPT_TOKENS), device="cuda")
    cache = prefilled_cache(model, prompt)
    elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
    graph = DraftStepGraph(model, cache, elb, PROMPT_TOKENS)
    token = torch.tensor([[65]], device="cuda")
    compiled = compare_compiled(model, prompt, elb, graph, token) if args.compile else None
    plain_ms = replay_ms(graph, token, args.reps)
    print(f"{args.model}: draft step (graph replay) median {plain_ms:.3f} ms")
    if compiled is not None:
        compiled_ms = replay_ms(compiled, token, args.reps)
        print(f"{args.model}: compiled draft step (graph replay) median {compiled_ms:.3f} ms, "
              f"plain / compiled {plain_ms / compiled_ms:.2f}")

    def eager_step():
        with model.observe_draft_routing(elb.observe):
            model.forward(token, cache, DRAFT)
        rollback(cache, elb, PROMPT_TOKENS)

    eager_step()
    rows = kernel_table(eager_step, "eager step", args.top) + kernel_table(lambda: graph.step(token), "graph replay",
                                                                            args.top)
    if compiled is not None:
        rows += kernel_table(lambda: compiled.step(token), "compiled graph replay", args.top)
    write_rows_csv(args.out / "profile.csv", rows)


def prefilled_cache(model, prompt: torch.Tensor):
    cache = new_static_cache(model, 256)
    model.forward(prompt, cache, TARGET)
    return cache


def chained_tokens(graph: DraftStepGraph, token: torch.Tensor, steps: int) -> list[int]:
    """Greedy draft tokens of `steps` chained replays from `token`; the graph's cache and counters are rolled
    back after."""
    out, current = [], token
    for _ in range(steps):
        current = graph.step(current)
        out.append(int(current[0]))
    rollback(graph.cache, graph.elb, PROMPT_TOKENS)
    return out


def forced_tokens(graph: DraftStepGraph, inputs: list[int]) -> list[int]:
    """The draft's next token after each of `inputs`, fed in order (teacher forcing); rolled back after."""
    out = [int(graph.step(torch.tensor([t], device=graph.token.device))[0]) for t in inputs]
    rollback(graph.cache, graph.elb, PROMPT_TOKENS)
    return out


def compare_compiled(model, prompt: torch.Tensor, elb, graph: DraftStepGraph, token: torch.Tensor) -> DraftStepGraph:
    """The compiled step captured over its own prefilled cache; prints its compile + capture time and
    whether its chained tokens equal the plain graph's."""
    start = time.perf_counter()
    compiled = DraftStepGraph(model, prefilled_cache(model, prompt), elb, PROMPT_TOKENS, compiled=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    plain_tokens, compiled_tokens = chained_tokens(graph, token, CHECK_STEPS), chained_tokens(compiled, token, CHECK_STEPS)
    same = "yes" if plain_tokens == compiled_tokens else f"no ({plain_tokens} vs {compiled_tokens})"
    forced = forced_tokens(compiled, [int(token[0])] + plain_tokens[:-1])  # the plain chain's inputs
    agree = sum(a == b for a, b in zip(forced, plain_tokens))
    print(f"compiled step: compile + capture {seconds:.1f} s; {CHECK_STEPS} chained tokens equal: {same}; "
          f"fed the plain chain's tokens it agrees on {agree} of {CHECK_STEPS} (fused kernels sum in "
          f"another order than eager's, so near-ties of random logits may flip)")
    return compiled


if __name__ == "__main__":
    main()
