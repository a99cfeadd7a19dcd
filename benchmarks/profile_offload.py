"""Where offloaded decoding's time goes (GPU): copy-stream busy/idle against compute, from a profiler trace.

    python benchmarks/profile_offload.py --model dsv2 --k 8 --tokens 48 --out DIR

Synthetic full-size weights (bf16, the default on CUDA), the mem preset's slots. After a warm-up, one generate() runs under
torch.profiler; the trace is split into time when expert copies and kernels overlap, when only one of
them runs, and when neither does (the GPU waits for the host), and the kernels that run while the
copy stream idles are listed. Profiling slows the host, so read the split, not the absolute times.
Writes profile_offload.json (the report) and, with --keep-trace, the Chrome trace.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specter  # noqa: E402
from specter.offload.runtime import offload_experts  # noqa: E402
from specter.device.trace_overlap import overlap_report, read_trace  # noqa: E402

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
STATS = ("tpot_ms", "draft_ms", "verify_ms", "wait_ms", "generated_tokens", "hit_rate", "decode_h2d_bytes_per_token")


def profile(engine, ids: torch.Tensor, tokens: int, trace: Path) -> dict:
    """One profiled generate(); its stats."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = engine.generate(ids, tokens)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    return {key: out.stats.get(key) for key in STATS}


def print_report(stats: dict, report: dict) -> None:
    print("stats (profiled run):", {k: round(v, 2) if isinstance(v, float) else v for k, v in stats.items()})
    span = report["span_ms"]
    for key in ("copy_busy_ms", "compute_busy_ms", "both_busy_ms", "copy_idle_compute_busy_ms",
                "compute_idle_copy_busy_ms", "idle_ms", "host_wait_ms"):
        print(f"  {key:28s} {report[key]:9.1f} ms  ({100 * report[key] / span:5.1f}% of {span:.1f} ms)")
    print(f"  expert copies: {report['expert_copies']}")
    print("kernels while the copy stream idles:")
    for name, ms in report["kernels_while_copy_idle"]:
        print(f"  {ms:8.2f} ms  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv2")
    parser.add_argument("--mem", default="high")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--keep-trace", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: profile_offload.py needs a CUDA GPU")
    model = specter.load_model(args.model, synthetic=True, device="cuda")  # bfloat16, the default on CUDA
    slots = model.spec.mem_presets[args.mem]
    offload_experts(model, slots)
    config = specter.SpecterConfig(k=args.k, resident_experts_per_layer=slots, prefetch=not args.no_prefetch)
    engine = specter.SpecterEngine(model, config)
    ids = torch.tensor([model.tokenizer(PROMPT)["input_ids"][:16]])
    engine.generate(ids, 16)  # warm-up: graph capture, Triton compilation
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = (args.out if args.keep_trace else Path(tmp)) / "trace.json"
        stats = profile(engine, ids, args.tokens, trace)
        report = overlap_report(read_trace(trace))
    print(f"{args.model} K={args.k} {slots} slots, {args.tokens} tokens")
    print_report(stats, report)
    (args.out / "profile_offload.json").write_text(json.dumps({"stats": stats, **report}, indent=1))


if __name__ == "__main__":
    main()
