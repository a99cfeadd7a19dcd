"""The copy link's recent bandwidth, from the copies that have finished: each copy is timed once."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

RECENT_COPIES = 64  # finished copies the estimate spans


class BandwidthMeter:
    """Bytes per ms over the last `window` finished copies, taken in issue order: a call times only the
    copies that finished since the last one (a copy still in flight holds back the ones after it)."""

    def __init__(self, window: int = RECENT_COPIES) -> None:
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)  # (bytes, ms) per finished copy
        self.timed = 0  # records before this index are in `recent` (or were, before it rolled over)

    def restart(self) -> None:
        """The copy records were cleared (a new request): forget every measurement."""
        self.recent.clear()
        self.timed = 0

    def measure(self, copies: Sequence, finished: Callable[[object], bool],
                elapsed_ms: Callable[[object, object], float]) -> float | None:
        """Bytes per ms of the recent finished `copies` (records with start, end, nbytes), None before any."""
        while self.timed < len(copies) and finished(copies[self.timed]):
            copy = copies[self.timed]
            self.recent.append((copy.nbytes, elapsed_ms(copy.start, copy.end)))
            self.timed += 1
        ms = sum(m for _, m in self.recent)
        return sum(b for b, _ in self.recent) / ms if ms > 0 else None
