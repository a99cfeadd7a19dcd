"""Residual decode groups: how consecutive loads share one decode launch, the loads waiting for theirs, and the
staging rows their blobs cross into."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class DecodeGroup(NamedTuple):
    """How consecutive residual loads share one decode launch: loads of one `key` (a layer), up to `size` of
    them; `launch(staging, items)` decodes them on the current stream, items being (staging row, blob words,
    destination, member) per load (`member`: what the caller passed with the load, e.g. the expert)."""

    key: object
    size: int
    launch: Callable


class PendingDecodes:
    """The residual loads whose blobs are copied and whose group decode is not launched yet: one ready event
    for all of them (recorded at the launch), the events the launch waits for (the last blob's arrival and
    the destination rows' last uses and copies), the staging rows it reads."""

    def __init__(self, group: DecodeGroup) -> None:
        self.group, self.ready = group, torch.cuda.Event(enable_timing=True)
        self.items, self.waits, self.rows, self.arrived = [], [], set(), None
        self.copies = []  # deferred blob copies: (staging row, blob, the decode that last read the row or None)

    def holds(self, *events) -> bool:
        return any(event is self.ready for event in events)

    def deferred_bytes(self) -> int:
        """Bytes of the blob copies waiting in the group (`group_copies`)."""
        return sum(blob.numel() * blob.element_size() for _, blob, _ in self.copies)


class StagingRows:
    """Device rows for residual blobs between their copy and their decode, taken in turn (`take`), made on first
    use and again for a longer blob (`allocate`); per row, the event of the decode that read it last (`reader`,
    None before any), which a copy into the row waits for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None  # [rows, capacity]
        self.rows: tuple = ()  # each row's view, made once
        self.reader: list = []
        self.taken = 0

    def fits(self, capacity: int) -> bool:
        return self.buffer is not None and self.buffer.shape[1] >= capacity

    def allocate(self, count: int, capacity: int, dtype: torch.dtype) -> None:
        """`count` rows of `capacity` elements (the old rows are dropped: nothing may still use them)."""
        self.buffer = torch.empty(count, capacity, dtype=dtype, device=self.device)
        self.rows, self.reader = self.buffer.unbind(0), [None] * count

    def take(self) -> int:
        """The next row, in turn."""
        self.taken += 1
        return (self.taken - 1) % len(self.rows)

    def view(self, row: int, words: int) -> torch.Tensor:
        """The first `words` elements of `row`."""
        return self.rows[row][:words]
