"""Host time of the copy-bandwidth estimate the planner reads at every draft checkpoint (CUDA).

    python scripts/bench_bandwidth_meter.py --copies 512 --calls 2000

Issues `--copies` pinned host-to-device copies of `--mb` MB, each between two timing events (as the offload
runtime records them), waits for them, and times per call, on the host: `BandwidthMeter.measure` (each
finished copy timed once, specter/offload/bandwidth.py) and a rescan of the last 64 copies (an event query
and elapsed_time per copy per call), both with no new copies and with one new finished copy per call.
Both must give the same bytes per ms on the same finished copies.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specter.offload.bandwidth import RECENT_COPIES, BandwidthMeter  # noqa: E402


class Record(NamedTuple):
    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int


def rescan(copies: list[Record]) -> float | None:
    """Bytes per ms over the finished copies among the last 64 issued, each timed again on every call."""
    done = [c for c in copies[-RECENT_COPIES:] if c.end.query()]
    ms = sum(c.start.elapsed_time(c.end) for c in done)
    return sum(c.nbytes for c in done) / ms if ms > 0 else None


def issue(copies: list[Record], dst: torch.Tensor, src: torch.Tensor, stream) -> None:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    copies.append(Record(start, end, src.numel() * src.element_size()))


def per_call_us(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=512)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mb", type=float, default=12.0, help="MB per copy (a dsv2 expert's residual blob: ~12)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench_bandwidth_meter.py needs a CUDA GPU")
    src = torch.ones(int(args.mb * 2**20) // 2, dtype=torch.float16).pin_memory()
    dst, stream = torch.empty_like(src, device="cuda"), torch.cuda.Stream()
    copies: list[Record] = []
    for _ in range(args.copies):
        issue(copies, dst, src, stream)
    torch.cuda.synchronize()
    meter = BandwidthMeter()
    finished = lambda c: c.end.query()  # noqa: E731
    elapsed = lambda a, b: a.elapsed_time(b)  # noqa: E731
    first = time.perf_counter()
    rate = meter.measure(copies, finished, elapsed)
    first_us = (time.perf_counter() - first) * 1e6
    same = abs(rate - rescan(copies)) <= 1e-9 * rate
    print(f"{args.copies} copies of {args.mb} MB: {rate / 1e6:.1f} GB/s; meter equals the rescan: {same}; "
          f"the meter's first call timed all {args.copies} copies in {first_us:.0f} us")
    idle_meter = per_call_us(lambda: meter.measure(copies, finished, elapsed), args.calls)
    idle_rescan = per_call_us(lambda: rescan(copies), args.calls)
    grow = []
    for _ in range(args.calls // 10):  # one new finished copy per call (the next copy is waited for untimed)
        issue(copies, dst, src, stream)
        stream.synchronize()
        t0 = time.perf_counter()
        meter.measure(copies, finished, elapsed)
        t1 = time.perf_counter()
        rescan(copies)
        grow.append((t1 - t0, time.perf_counter() - t1))
    grow_meter = sum(a for a, _ in grow) / len(grow) * 1e6
    grow_rescan = sum(b for _, b in grow) / len(grow) * 1e6
    print("| case | meter us / call | rescan us / call | rescan / meter |")
    print("|---|---|---|---|")
    print(f"| no new copy | {idle_meter:.1f} | {idle_rescan:.1f} | {idle_rescan / idle_meter:.1f} |")
    print(f"| one new copy | {grow_meter:.1f} | {grow_rescan:.1f} | {grow_rescan / grow_meter:.1f} |")
    if not same:
        sys.exit("error: the meter's bytes per ms differ from the rescan's")


if __name__ == "__main__":
    main()
