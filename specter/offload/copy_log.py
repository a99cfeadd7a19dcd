"""What the offload streams log of their copies, compute stalls and residual decodes, and the numbers read from it."""
from __future__ import annotations

from typing import NamedTuple

from specter.offload.bandwidth import BandwidthMeter


class CopyRecord(NamedTuple):
    """One expert copy, or `copies` back-to-back copies issued together: start and end (events on CUDA,
    perf_counter on CPU), bytes, and the event it waited for (the last use of the device row it writes;
    None if none)."""

    start: object
    end: object
    nbytes: int
    after: object = None
    copies: int = 1
    calls: int = 1  # copy calls they took (blobs adjacent in host and device memory cross as one)


class CopyLog:
    """Since the last `reset`: the copies (`CopyRecord`), the compute stream's stalls and the residual decodes,
    each timed by a pair of events on CUDA (perf_counter values on CPU), and the link's recent bandwidth."""

    def __init__(self) -> None:
        self.copies: list[CopyRecord] = []
        self.stalls: list[tuple] = []  # (start, end, awaited ready events) around the compute stream's waits
        self.decodes: list[tuple] = []  # (start, end) of each residual decode launch
        self.rebuilds: list[tuple] = []  # (start, end) of the decodes that run on the compute stream itself
        self.bandwidth = BandwidthMeter()  # recent bytes per ms of the finished copies

    def reset(self) -> None:
        self.copies, self.stalls, self.decodes, self.rebuilds = [], [], [], []
        self.bandwidth.restart()

    def stats(self, nbytes: int) -> dict:
        """Copies, copy calls, busy time and GB/s (`nbytes` copied), stall time, decodes and their time (every
        event must have completed)."""
        copy_ms = sum(elapsed_ms(c.start, c.end) for c in self.copies)
        return {
            "h2d_bytes": nbytes,
            "h2d_copies": sum(c.copies for c in self.copies),
            "h2d_copy_calls": sum(c.calls for c in self.copies),  # fewer where adjacent blobs cross as one
            "h2d_busy_ms": copy_ms,
            "h2d_gbps": nbytes / copy_ms / 1e6 if copy_ms > 0 else float("nan"),
            "wait_ms": sum(elapsed_ms(a, b) for a, b, _ in self.stalls),
            "residual_decodes": len(self.decodes),
            "residual_decode_ms": sum(elapsed_ms(a, b) for a, b in self.decodes),
        }

    def copied_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def spans_ms(self, at) -> list[tuple[float, float, float | None]]:
        """(start, end, slot free) of every copy, each event placed by `at` (None for no event)."""
        return [(at(c.start), at(c.end), at(c.after)) for c in self.copies]

    def critical_path_ms(self, at) -> tuple[list[tuple[float, float, float]], list[tuple[float, float]]]:
        """What held the compute stream, each event placed by `at` (ms; every event must have completed):
        per stall (start, waiting for copies, waiting for rebuilds), and (start, end) of each rebuild on the
        compute stream. A stall waits for its last awaited event: from the moment that event's decode began
        (a rebuild on the decode stream) to the stall's end the stall is the rebuild's, before it the copy's;
        a stall whose last event is a plain copy is all the copy's."""
        began = {id(end): start for start, end in self.decodes}  # a decode's ready event -> its start
        stalls = []
        for start, end, awaited in self.stalls:
            a, b = at(start), at(end)
            last = max(awaited, key=at) if awaited else None
            rebuild = 0.0 if id(last) not in began else min(max(b - at(began[id(last)]), 0.0), b - a)
            stalls.append((a, b - a - rebuild, rebuild))
        return stalls, [(at(a), at(b)) for a, b in self.rebuilds]

    def measured_bandwidth(self, finished) -> float | None:
        """Bytes per ms over the last copies that have `finished` (non-blocking), or None if none has."""
        return self.bandwidth.measure(self.copies, finished, elapsed_ms)


def elapsed_ms(start, end) -> float:
    """Milliseconds between two events (or two perf_counter values)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)
