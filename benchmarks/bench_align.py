"""Device time of the expert alignment (`moe_align_block_size`) per model shape and window length (GPU).

    python benchmarks/bench_align.py --out DIR

Per (experts, top_k) of dsv2, qwen, phi and mixtral and per window of T tokens: the mean device time of one
alignment over `--launches` back-to-back launches (CUDA events, one workspace, after a warm-up launch), in
microseconds, and the compiled kernels the workspace holds afterwards. A row per case in DIR/align.csv.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import RowLog  # noqa: E402
from specter.kernels.moe_align import MoEWorkspace, moe_align_block_size  # noqa: E402
from specter.metrics import format_row  # noqa: E402

SHAPES = {"dsv2": (64, 6), "qwen": (60, 4), "phi": (16, 2), "mixtral": (8, 2)}  # experts, top_k
WINDOWS = (1, 4, 8, 16, 25, 33)
BLOCK_M = 16


def time_alignment(experts: int, top_k: int, tokens: int, launches: int, workspace: MoEWorkspace) -> float:
    """Mean microseconds of device time per alignment of a random [tokens, top_k] routing."""
    routing = torch.rand(tokens, experts, device="cuda").topk(top_k).indices  # [T, k]
    moe_align_block_size(routing, experts, BLOCK_M, workspace)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        moe_align_block_size(routing, experts, BLOCK_M, workspace)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_align.py needs a CUDA GPU")
    log = RowLog(args.out / "align.csv") if args.out else None
    workload = f"block_m={BLOCK_M}, {args.launches} launches per case, random routing"
    for model, (experts, top_k) in SHAPES.items():
        workspace = MoEWorkspace()
        for tokens in WINDOWS:
            row = {"model": model, "experts": experts, "top_k": top_k, "tokens": tokens,
                   "us_per_align": round(time_alignment(experts, top_k, tokens, args.launches, workspace), 2),
                   "compiled_kernels": workspace.compiled_kernels()}
            print(format_row(row), flush=True)
            if log is not None:
                log.add(row, workload)


if __name__ == "__main__":
    main()
