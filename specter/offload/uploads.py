"""Uploads: small host tensors to the device on the current stream, staged in rings of pinned buffers."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Pinned buffers a ring rotates through (`upload`: per ring and dtype; `upload_map`, `upload_rows`: per ring and
# shape): the host issues a decode group's table or a wave's map many launches before the GPU reaches them, and
# waits only when a buffer comes round again before its last copy has run.
RING_BUFFERS = 64


class UploadRings:
    """Copies of small host tensors to `device` that never make the host wait for the GPU's queue: each goes
    through one of a ring's pinned buffers, reused only once its previous copy has run (the host waits for
    that copy alone, if it has not). `current_stream()` gives the stream the copies are enqueued on; None
    on CPU, where the tensors stay on the host."""

    def __init__(self, device: torch.device, current_stream: Callable | None) -> None:
        self.device, self.current_stream = device, current_stream
        self.buffers: dict = {}  # (ring, dtype, index) -> (pinned host buffer, event of its last copy)
        self.counts: dict = {}  # (ring, dtype) -> uploads so far
        self.views: dict = {}  # `upload_map`'s and `upload_rows`' buffer key -> (pinned buffer, its numpy view)
        self.wait_ms = 0.0  # host time waiting for a buffer's previous copy to run

    def reset_stats(self) -> None:
        self.wait_ms = 0.0

    def upload(self, tensor: torch.Tensor, ring: str = "compute") -> torch.Tensor:
        """`tensor` on the device, staged in one of RING_BUFFERS pinned buffers of `ring` (a stream of its own
        gets a ring of its own). On CPU the tensor itself."""
        if self.current_stream is None:
            return tensor
        key = self._next_buffer((ring, tensor.dtype))
        buffer = self.buffers.get(key, (None, None))[0]
        if buffer is None or buffer.numel() < tensor.numel():
            buffer = torch.empty(max(tensor.numel(), 1), dtype=tensor.dtype, pin_memory=True)
        staged = buffer[:tensor.numel()].view(tensor.shape)
        staged.copy_(tensor)
        return self._send(key, buffer, staged)

    def upload_map(self, size: int, entries: list[tuple[int, int]], ring: str = "maps") -> torch.Tensor:
        """[size] int64 on the device: v at i for each (i, v) of `entries`, -1 elsewhere (a verify wave's expert
        -> pool row map), written through numpy into `ring`'s next buffer (`_int64_buffer`)."""
        key, buffer, values = self._int64_buffer((ring, size), (size,))
        values[:] = -1
        for index, value in entries:
            values[index] = value
        return self._send(key, buffer, buffer)

    def upload_rows(self, rows: list[tuple[int, ...]], width: int, ring: str = "rows") -> torch.Tensor:
        """[len(rows), width] int64 on the device from `rows` (tuples of `width` ints, e.g. a decode group's
        table), written through numpy into `ring`'s next buffer (`_int64_buffer`)."""
        key, buffer, values = self._int64_buffer((ring, len(rows), width), (len(rows), width))
        values[:] = rows
        return self._send(key, buffer, buffer)

    def _int64_buffer(self, ring: tuple, shape: tuple) -> tuple:
        """(key, int64 buffer of `shape`, its numpy view) to fill: `ring`'s next pinned buffer, kept per ring
        (a ring keeps one shape; no host tensor op but the copy); on CPU a fresh host tensor and key None."""
        if self.current_stream is None:
            buffer = torch.empty(shape, dtype=torch.long)
            return None, buffer, buffer.numpy()
        key = self._next_buffer((ring, torch.long))
        if key not in self.views:
            buffer = torch.empty(shape, dtype=torch.long, pin_memory=True)
            self.views[key] = (buffer, buffer.numpy())
        return (key, *self.views[key])

    def _next_buffer(self, ring: tuple) -> tuple:
        """The key of `ring`'s next pinned buffer (of RING_BUFFERS), once that buffer's previous copy has run."""
        used = self.counts.get(ring, 0)
        self.counts[ring] = used + 1
        key = (*ring, used % RING_BUFFERS)
        last = self.buffers.get(key, (None, None))[1]
        if last is not None and not last.query():
            start = time.perf_counter()
            last.synchronize()
            self.wait_ms += (time.perf_counter() - start) * 1e3
        return key

    def _send(self, key: tuple | None, buffer: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
        """`staged` (a view of the pinned `buffer`) to the device on the current stream; the buffer is kept under
        `key` with the event of this copy. On CPU (key None) `staged` itself."""
        if key is None:
            return staged
        on_device = staged.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.current_stream())
        self.buffers[key] = (buffer, copied)
        return on_device
