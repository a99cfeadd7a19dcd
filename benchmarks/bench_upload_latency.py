"""Does a small upload on the compute stream wait behind the copy stream's expert copies? (GPU)

    python benchmarks/bench_upload_latency.py --copy-mb 8.6 --out DIR

The verify pass uploads each wave's expert -> row map (and each rebuild's table) to the device on the compute
stream while the copy stream moves experts. This times, with CUDA events on the compute stream, N rounds of
[upload a 512-byte pinned map, one tiny kernel reading it], alone and while the copy stream runs back-to-back
pinned copies of `--copy-mb` MB, against the same rounds reading a map already on the device. One process; each
row's microseconds per round, and the loaded rows over the idle ones.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import RowLog  # noqa: E402
from specter.metrics import format_row  # noqa: E402

ROUNDS = 200


def rounds_us(upload: bool, background: torch.cuda.Stream | None, copies: list, rounds: int) -> float:
    """Microseconds per round on the compute stream, the copy stream busy with `copies` when `background`."""
    host = torch.arange(64, dtype=torch.int64).pin_memory()  # 512 bytes
    resident = host.cuda()
    out = torch.zeros(64, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    if background is not None:
        with torch.cuda.stream(background):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        table = host.to("cuda", non_blocking=True) if upload else resident
        out.add_(table)
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end) * 1e3 / rounds
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-mb", type=float, default=8.6, help="one background copy (a qwen blob: 8.6)")
    parser.add_argument("--copies", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_upload_latency.py needs a CUDA GPU")
    numel = int(args.copy_mb * 2**20) // 4
    sources = [torch.empty(numel, dtype=torch.int32).pin_memory() for _ in range(4)]
    targets = [torch.empty(numel, dtype=torch.int32, device="cuda") for _ in range(4)]
    copies = [(targets[i % 4], sources[i % 4]) for i in range(args.copies)]
    background = torch.cuda.Stream()
    rounds_us(True, None, copies, 20)  # warm-up
    log = RowLog(args.out / "upload_latency.csv") if args.out else None
    workload = f"{ROUNDS} rounds of a 512-byte upload and a kernel; background: {args.copies} x {args.copy_mb} MB"
    rows = []
    for upload in (False, True):
        for busy in (False, True):
            us = rounds_us(upload, background if busy else None, copies, ROUNDS)
            rows.append({"map": "uploaded" if upload else "on device", "copy_stream": "busy" if busy else "idle",
                         "us_per_round": round(us, 2)})
    idle = {row["map"]: row["us_per_round"] for row in rows if row["copy_stream"] == "idle"}
    for row in rows:
        row["over_idle"] = round(row["us_per_round"] / idle[row["map"]], 2)
        print(format_row(row), flush=True)
        if log is not None:
            log.add(row, workload)


if __name__ == "__main__":
    main()
