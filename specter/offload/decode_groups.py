"""Residual decode groups: how consecutive loads share one decode launch, and the loads waiting for theirs."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class DecodeGroup(NamedTuple):
    """How consecutive residual loads share one decode launch: loads of one `key` (a layer), up to `size` of
    them; `launch(staging, items)` decodes them on the current stream, items being (blob offset in the staging
    buffer's words, blob words, destination, member) per load (`member`: what the caller passed with the load, e.g. the expert)."""

    key: object
    size: int
    launch: Callable


class PendingDecodes:
    """The residual loads whose blobs are copied and whose group decode is not launched yet: one ready event
    for all of them (recorded at the launch), the events the launch waits for (the last blob's arrival and
    the destination rows' last uses and copies), the staging rows it reads."""

    def __init__(self, group: DecodeGroup) -> None:
        self.group, self.ready = group, torch.cuda.Event(enable_timing=True)
        self.items, self.waits, self.arrived = [], [], None
        self.rows = {}  # staging rows the group reads -> the decode that read each before it (deferred copies)
        self.copies = []  # deferred blob copies: (staging word offset, blob, the decodes that last read its rows)

    def holds(self, *events) -> bool:
        return any(event is self.ready for event in events)

    def deferred_bytes(self) -> int:
        """Bytes of the blob copies waiting in the group (`group_copies`)."""
        return sum(blob.numel() * blob.element_size() for _, blob, _ in self.copies)
