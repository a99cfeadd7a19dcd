"""What the first decode of a prompt pays over its second, with the cuDNN attention backend and without it (GPU).

    python benchmarks/bench_first_decode.py --model qwen --mem high --weights calibrated --prompts 2 --out DIR

A decode that meets window lengths (query shapes of the target pass) the warm-up did not can pay a one-off for them:
a kernel compiled for a new shape class, an attention backend's per-shape setup (cuDNN's SDPA builds an execution
graph per new query length), a pinned buffer allocated (results/reference/first-decode-h100). In one process, per
mode (cuDNN SDPA off, then on: `torch.backends.cuda.enable_cudnn_sdp`), a Specter engine of its own (the default
config, K the model's for the memory setting, its draft graph captured under that mode) decodes the built-in warm-up
prompt once, then `--prompts` prompts from each local dataset twice each (the GC paused); the modes' dataset prompts
are disjoint, so that neither mode meets the other's shapes first. Each decode is a row of DIR/first_decode.csv; a
table per mode gives the first and second decodes' TPOT and target-pass time per token, and the one-off: (first -
second TPOT) x tokens, in ms per decode. Each row also says what the decode made the process set up: Triton kernels
compiled (entries added to TRITON_CACHE_DIR, when set to a fresh folder, and their kernels' names), device memory
segments allocated (cudaMalloc) and pinned host blocks created with the host time they took.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specter  # noqa: E402
from benchmarks.row_log import RowLog  # noqa: E402
from experiments.datasets import load_prompts, local_datasets  # noqa: E402
from specter.metrics import format_row, gc_paused  # noqa: E402

WARMUP_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
PREFIX_TOKENS = 16  # the harness's protocol
MODES = (("cudnn_sdp_off", False), ("cudnn_sdp_on", True))  # off first: it builds no cuDNN graph for the other


def disjoint_prompts(prompts: dict[str, list], modes: int, per_mode: int) -> list[dict[str, list]]:
    """Per mode, `per_mode` prompts of each dataset, no prompt in two modes (dataset -> its prompts in order)."""
    return [{name: texts[m * per_mode:(m + 1) * per_mode] for name, texts in prompts.items()} for m in range(modes)]


def triton_entries() -> set[Path]:
    """The entries of TRITON_CACHE_DIR (one per compiled kernel), empty when it is not set."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    return set(Path(cache).iterdir()) if cache and Path(cache).is_dir() else set()


def kernel_names(entries: set[Path]) -> str:
    """The kernels that Triton cache `entries` hold, e.g. "_align_kernel+_slot_down_kernel" ("" for none)."""
    names = {f.stem for entry in entries if entry.is_dir() for f in entry.glob("*.json")
             if not f.name.startswith("__grp__")}
    return "+".join(sorted(names))


def setup_counters() -> dict:
    """What the process has set up so far: Triton cache entries (TRITON_CACHE_DIR, when set), device memory
    segments allocated, pinned host blocks created and the host ms spent creating them."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    host = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return {"triton_compiles": len(triton_entries()) if cache and Path(cache).is_dir() else float("nan"),
            "device_segments": torch.cuda.memory_stats().get("segment.all.allocated", 0)
            if torch.cuda.is_available() else 0,
            "host_blocks": host.get("num_host_alloc", float("nan")),
            "host_alloc_ms": host.get("host_alloc_time.total", float("nan")) / 1000}


def counters_since(before: dict, entries: set[Path]) -> dict:
    """`setup_counters()` now minus `before` (taken with Triton cache `entries`): what the process set up in
    between, with the names of the kernels compiled."""
    counts = {name: value - before[name] for name, value in setup_counters().items()}
    return {**counts, "triton_kernels": kernel_names(triton_entries() - entries)}


def decode_twice(engine, prompts: dict[str, list[torch.Tensor]], tokens: int) -> list[dict]:
    """Each prompt decoded twice in a row: a row per decode (dataset, prompt, decode 1 or 2, TPOT, target pass)."""
    rows = []
    for name, ids_list in prompts.items():
        for index, ids in enumerate(ids_list):
            for decode in (1, 2):
                before, entries = setup_counters(), triton_entries()
                with gc_paused():
                    stats = engine.generate(ids, tokens).stats
                rows.append({"dataset": name, "prompt": index, "decode": decode, "tpot_ms": stats["tpot_ms"],
                             "tpot_target_ms": stats.get("tpot_target_ms", float("nan")),
                             "tpot_draft_ms": stats.get("tpot_draft_ms", float("nan")),
                             "tokens": stats["generated_tokens"], **counters_since(before, entries)})
    return rows


def one_off(rows: list[dict]) -> dict:
    """The first decodes against the second ones: mean TPOT and target pass of each, and the one-off per decode
    (ms): the first's TPOT over the second's, times the tokens after the first."""
    first = [r for r in rows if r["decode"] == 1]
    second = {(r["dataset"], r["prompt"]): r for r in rows if r["decode"] == 2}
    extra = [(r["tpot_ms"] - second[(r["dataset"], r["prompt"])]["tpot_ms"]) * (r["tokens"] - 1) for r in first]
    return {"first_tpot_ms": mean(r["tpot_ms"] for r in first),
            "second_tpot_ms": mean(r["tpot_ms"] for r in second.values()),
            "first_target_ms": mean(r["tpot_target_ms"] for r in first),
            "second_target_ms": mean(r["tpot_target_ms"] for r in second.values()),
            "one_off_ms_per_decode": mean(extra)}


def measure_mode(model, config: specter.SpecterConfig, cudnn: bool, prompts: dict[str, list[torch.Tensor]],
                 tokens: int) -> list[dict]:
    """One mode: cuDNN SDPA set to `cudnn` for a fresh engine's warm-up and every decode (`decode_twice`)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        engine = specter.SpecterEngine(model, config)
        warm = torch.tensor([model.tokenizer(WARMUP_PROMPT)["input_ids"][:PREFIX_TOKENS]])
        engine.generate(warm, tokens)
        return decode_twice(engine, prompts, tokens)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen")
    parser.add_argument("--mem", default="high")
    parser.add_argument("--weights", choices=("synthetic", "calibrated"), default="calibrated")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per local dataset and mode")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=[name for name, _ in MODES], default=[n for n, _ in MODES],
                        help="cuDNN SDPA modes to measure, in MODES' order")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_first_decode.py needs a CUDA GPU")
    names = local_datasets()
    if not names:
        sys.exit("error: no local dataset file (set SPECTER_DATA)")
    model = specter.load_model(args.model, weights=args.weights, device="cuda")
    slots = model.spec.mem_presets[args.mem]
    config = specter.SpecterConfig(k=model.spec.k_for(slots), resident_experts_per_layer=slots)
    modes = [(name, cudnn) for name, cudnn in MODES if name in args.modes]
    texts = {name: load_prompts(name, args.prompts * len(modes)) for name in names}
    encode = lambda t: torch.tensor([model.tokenizer(t)["input_ids"][:PREFIX_TOKENS]])  # noqa: E731
    split = disjoint_prompts({n: [encode(t) for t in ts] for n, ts in texts.items()}, len(modes), args.prompts)
    log = RowLog(args.out / "first_decode.csv") if args.out else None
    workload = (f"{args.model} {args.weights} mem={args.mem} K={config.k} {args.prompts} prompts x {args.new_tokens} "
                f"tokens per dataset ({', '.join(names)}) and mode, each decoded twice")
    print(workload, flush=True)
    for (mode, cudnn), prompts in zip(modes, split):
        rows = measure_mode(model, config, cudnn, prompts, args.new_tokens)
        for row in rows:
            print(format_row({"mode": mode, **{k: round(v, 3) if isinstance(v, float) else v
                                               for k, v in row.items()}}), flush=True)
            if log is not None:
                log.add({"mode": mode, **row}, workload)
        print(format_row({"mode": mode, **{k: round(v, 3) for k, v in one_off(rows).items()}}), flush=True)


if __name__ == "__main__":
    main()
