"""Overlap of expert copies and compute in a torch.profiler (Kineto) trace: where the copy stream idles."""
from __future__ import annotations

import json
from bisect import bisect_left
from collections import defaultdict
from pathlib import Path

EXPERT_COPY_MIN_BYTES = 1 << 20  # smaller host-to-device copies are slot maps and token ids, not experts
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def read_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome trace written by `torch.profiler.profile.export_chrome_trace`."""
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and disjoint."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The gaps of merged `intervals` inside [start, end)."""
    gaps, cursor = [], start
    for s, e in intervals:
        if s > cursor:
            gaps.append((cursor, min(s, end)))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))
    return [(s, e) for s, e in gaps if e > s]


def copy_idle_by_phase(copies: list[tuple], phases: dict[str, list[tuple[float, float]]]) -> dict:
    """copy_idle_<phase>_ms: time of each phase (its spans) during which no expert copy ran, and
    copy_idle_between_ms: the same between the first and last phase span outside every phase.
    copies: (start, end, ...) in ms; with their slot-free times, also `copy_gaps_by_cause`."""
    busy, stats = merge([(c[0], c[1]) for c in copies]), {}
    for name, spans in phases.items():
        spans = merge(spans)
        stats[f"copy_idle_{name}_ms"] = length(spans) - length(intersect(spans, busy))
    every = merge([span for spans in phases.values() for span in spans])
    if every:
        gaps = complement(every, every[0][0], every[-1][1])
        stats["copy_idle_between_ms"] = length(gaps) - length(intersect(gaps, busy))
        if copies and len(copies[0]) > 2:
            stats.update(copy_gaps_by_cause(copies, every[0][0], every[-1][1]))
    return stats


def copy_gaps_by_cause(copies: list[tuple[float, float, float | None]], start: float, end: float) -> dict:
    """Why the copy stream idled inside [start, end): each gap ends when the next copy starts; the part of
    the gap before that copy's slot was free (its last reader had not finished) is copy_gap_slot_ms, the
    rest (the copy had not been issued yet, or nothing was left to copy) copy_gap_host_ms.
    copies: (start, end, slot free or None) in ms."""
    ordered = sorted(copies, key=lambda c: (c[0], c[1]))  # (slot-free times may be None: never compared)
    starts = [c[0] for c in ordered]
    slot = host = 0.0
    for g0, g1 in complement(merge([(c[0], c[1]) for c in ordered]), start, end):
        i = bisect_left(starts, g1)
        free = ordered[i][2] if i < len(ordered) and ordered[i][0] == g1 else None
        waited = 0.0 if free is None else min(max(free - g0, 0.0), g1 - g0)
        slot, host = slot + waited, host + (g1 - g0 - waited)
    return {"copy_gap_slot_ms": slot, "copy_gap_host_ms": host}


def _interval(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def expert_copies(events: list[dict]) -> list[dict]:
    """Host-to-device copies of at least an expert's order of size (by bytes, else by a 50 us duration)."""
    def big(event: dict) -> bool:
        nbytes = event.get("args", {}).get("bytes")
        return int(nbytes) >= EXPERT_COPY_MIN_BYTES if nbytes is not None else float(event.get("dur", 0)) >= 50
    return [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and big(e)]


def overlap_report(events: list[dict], top: int = 10) -> dict:
    """Busy and idle time of the copy stream (expert loads) and of the GPU's kernels, in ms.

    copy_idle_compute_busy: kernels ran while no expert was being copied (the copy stream waited for
    a slot, i.e. for compute, or had nothing queued); idle: neither (the GPU waited for the host).
    `kernels_while_copy_idle` names the kernels that ran while the copy stream idled, by time.
    """
    copies = merge([_interval(e) for e in expert_copies(events)])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    compute = merge([_interval(e) for e in kernels])
    if not copies and not compute:
        raise ValueError("the trace has no GPU kernels or copies")
    start = min(s for s, _ in copies + compute)
    end = max(e for _, e in copies + compute)
    copy_idle = complement(copies, start, end)
    both = intersect(copies, compute)
    by_kernel: dict[str, float] = defaultdict(float)
    for event in kernels:
        overlap = length(intersect([_interval(event)], copy_idle))
        if overlap > 0:
            by_kernel[event["name"][:80]] += overlap / 1e3
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in HOST_WAITS]
    ms = lambda us: us / 1e3  # noqa: E731  (trace times are in microseconds)
    return {
        "span_ms": ms(end - start),
        "copy_busy_ms": ms(length(copies)),
        "compute_busy_ms": ms(length(compute)),
        "both_busy_ms": ms(length(both)),
        "copy_idle_compute_busy_ms": ms(length(compute) - length(both)),
        "compute_idle_copy_busy_ms": ms(length(copies) - length(both)),
        "idle_ms": ms(end - start - length(copies) - length(compute) + length(both)),
        "expert_copies": len(expert_copies(events)),
        "host_wait_ms": ms(sum(float(e.get("dur", 0.0)) for e in waits)),
        "kernels_while_copy_idle": sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top],
    }
