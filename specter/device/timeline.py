"""The one place where Specter touches device timing and host synchronisation: timestamps and host reads."""
from __future__ import annotations

import time

import torch


class Timeline:
    """Timestamps on the decode path: CUDA events on a GPU (no sync when taken), perf_counter on CPU.

    `mark()` returns the index of a new timestamp; `elapsed_ms(i, j)` is read after decoding, so on a GPU
    the host waits once, at the end, not at every mark.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def elapsed_ms(self, start: int, end: int) -> float:
        return self.offset_ms(self._marks[end], self._marks[start])

    def offset_ms(self, stamp, origin=None, wait: bool = True) -> float:
        """ms from `origin` (default: the first mark) to `stamp`, a CUDA event or perf_counter value taken
        the same way as the marks (e.g. a copy's events on another stream); wait=False: the caller has
        synchronised already."""
        origin = self._marks[0] if origin is None else origin
        if self.cuda:
            if wait:
                stamp.synchronize()
            return origin.elapsed_time(stamp)
        return (stamp - origin) * 1e3


def to_host(tensor: torch.Tensor) -> list:
    """Copy a small decision tensor (accepted tokens, counts) to the host; the host waits for it."""
    return tensor.tolist()
