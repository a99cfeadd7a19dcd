"""Residual-coded slots: device rows that keep each MoE layer's recent residual blobs, so a reload copies nothing."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class HeldRow(NamedTuple):
    """Where a residual load's blob lies on the device: `row` of the staging rows, `present` when the blob is
    already there (no copy: the decode reads it), `rows` the staging rows the blob slots need in all."""

    row: int
    present: bool
    rows: int


class BlobSlots:
    """`per_layer` staging rows per MoE layer holding residual blobs after their decode, least recently loaded
    first. A load of an expert whose blob a row still holds moves no bytes (the decode rebuilds the 16-bit
    expert from the row); any other load takes the layer's free row or its least recently loaded one. Layer l
    owns rows [l * per_layer, (l + 1) * per_layer) of the staging buffer."""

    def __init__(self, layers: int, per_layer: int) -> None:
        if per_layer < 1:
            raise ValueError(f"blob slots per layer must be >= 1, got {per_layer}")
        self.layers, self.per_layer = layers, per_layer
        self.clear()

    @property
    def rows(self) -> int:
        return self.layers * self.per_layer

    def clear(self) -> None:
        """Forget every blob (the rows' contents are no longer trusted)."""
        self.held = [OrderedDict() for _ in range(self.layers)]  # per layer: expert -> row, least recent first
        self.free = [list(range((layer + 1) * self.per_layer - 1, layer * self.per_layer - 1, -1))
                     for layer in range(self.layers)]  # popped from the end: the layer's first row first

    def place(self, layer: int, expert: int) -> HeldRow:
        """The row of `expert`'s blob for a load now: the row holding it (present), else a free row or the
        layer's least recently loaded one (its blob forgotten), which the load's copy fills."""
        held = self.held[layer]
        row = held.get(expert)
        if row is not None:
            held.move_to_end(expert)
            return HeldRow(row, True, self.rows)
        row = self.free[layer].pop() if self.free[layer] else held.popitem(last=False)[1]
        held[expert] = row
        return HeldRow(row, False, self.rows)

    def holds(self, layer: int, expert: int) -> bool:
        return expert in self.held[layer]


def blob_rows_per_layer(slots: int, expert_bytes: int, blob_bytes: int) -> int:
    """Blob rows that `slots` 16-bit slots' memory holds (each row as long as the longest blob)."""
    return slots * expert_bytes // blob_bytes
