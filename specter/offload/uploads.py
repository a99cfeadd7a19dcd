"""Uploads: small host int64 tables to the device on the current stream, staged in rings of pinned buffers."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Pinned buffers a ring rotates through: the host issues a decode group's table or a wave's map many launches
# before the GPU reaches them, and waits only when a buffer comes round again before its last copy has run.
RING_BUFFERS = 64
MIN_CAPACITY = 64  # int64 entries per buffer of a ring's first slab


def slab_capacity(numel: int, current: int = 0) -> int:
    """Entries per buffer of a ring's slab for a table of `numel` entries, given its slab's `current` capacity (0:
    none yet): `current` where the table fits, else at least twice it, a power of two >= numel, MIN_CAPACITY or more."""
    if current and numel <= current:
        return current
    return max(MIN_CAPACITY, 1 << max(numel - 1, 0).bit_length(), 2 * current)


class UploadRings:
    """Copies of small host tables to `device` that never make the host wait for the GPU's queue: each goes
    through one of a ring's pinned buffers, reused only once its previous copy has run (the host waits for
    that copy alone, if it has not). A ring's RING_BUFFERS buffers are the rows of one pinned slab, whatever
    the tables' shapes: a table longer than the slab's rows makes a slab with twice the rows (or more), so
    pinned allocations (host time, and synchronising ones) stay a handful per ring instead of one per buffer
    and shape. `current_stream()` gives the stream the copies are enqueued on; None on CPU, where the tables
    stay on the host."""

    def __init__(self, device: torch.device, current_stream: Callable | None) -> None:
        self.device, self.current_stream = device, current_stream
        self.slabs: dict = {}  # ring -> pinned int64 slab [RING_BUFFERS, capacity]
        self.views: dict = {}  # (ring, index, shape) -> (view of the slab's row `index`, its numpy view)
        self.copies: dict = {}  # (ring, index) -> event of that buffer's last copy
        self.counts: dict = {}  # ring -> uploads so far
        self.wait_ms = 0.0  # host time waiting for a buffer's previous copy to run

    def reset_stats(self) -> None:
        self.wait_ms = 0.0

    def upload_map(self, size: int, entries: list[tuple[int, int]], ring: str = "maps") -> torch.Tensor:
        """[size] int64 on the device: v at i for each (i, v) of `entries`, -1 elsewhere (a verify wave's expert
        -> pool row map), written through numpy into `ring`'s next buffer (`_int64_buffer`)."""
        key, buffer, values = self._int64_buffer(ring, (size,))
        values[:] = -1
        for index, value in entries:
            values[index] = value
        return self._send(key, buffer)

    def upload_rows(self, rows: list[tuple[int, ...]], width: int, ring: str = "rows") -> torch.Tensor:
        """[len(rows), width] int64 on the device from `rows` (tuples of `width` ints, e.g. a decode group's
        table), written through numpy into `ring`'s next buffer (`_int64_buffer`)."""
        key, buffer, values = self._int64_buffer(ring, (len(rows), width))
        values[:] = rows
        return self._send(key, buffer)

    def _int64_buffer(self, ring: str, shape: tuple) -> tuple:
        """(key, int64 tensor of `shape` in `ring`'s next pinned buffer, its numpy view) to fill, the views kept
        per buffer and shape (no host tensor op but the copy); on CPU a fresh host tensor and key None."""
        if self.current_stream is None:
            buffer = torch.empty(shape, dtype=torch.long)
            return None, buffer, buffer.numpy()
        index = self._next_index(ring)
        view = self.views.get((ring, index, shape))
        if view is None:
            numel = 1
            for size in shape:
                numel *= size
            staged = self._slab(ring, numel)[index, :numel].view(shape)
            view = self.views[(ring, index, shape)] = (staged, staged.numpy())
        return ((ring, index), *view)

    def _slab(self, ring: str, numel: int) -> torch.Tensor:
        """`ring`'s pinned slab, [RING_BUFFERS, capacity] with capacity >= `numel` (`slab_capacity`): a larger one
        replaces a slab too small, and the views into the old one go (copies still reading it keep its memory:
        the pinned allocator reuses a block only after the copies recorded on it have run)."""
        slab = self.slabs.get(ring)
        current = 0 if slab is None else slab.shape[1]
        capacity = slab_capacity(numel, current)
        if capacity != current:
            self.views = {key: view for key, view in self.views.items() if key[0] != ring}
            slab = self.slabs[ring] = torch.empty((RING_BUFFERS, capacity), dtype=torch.long, pin_memory=True)
        return slab

    def _next_index(self, ring: str) -> int:
        """`ring`'s next buffer (of RING_BUFFERS), once that buffer's previous copy has run."""
        used = self.counts.get(ring, 0)
        self.counts[ring] = used + 1
        index = used % RING_BUFFERS
        last = self.copies.get((ring, index))
        if last is not None and not last.query():
            start = time.perf_counter()
            last.synchronize()
            self.wait_ms += (time.perf_counter() - start) * 1e3
        return index

    def _send(self, key: tuple | None, staged: torch.Tensor) -> torch.Tensor:
        """`staged` (a view of a ring's pinned slab) to the device on the current stream, the event of this copy
        kept for its buffer `key`. On CPU (key None) `staged` itself."""
        if key is None:
            return staged
        on_device = staged.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.current_stream())
        self.copies[key] = copied
        return on_device
