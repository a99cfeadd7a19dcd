"""Residual-coded slots: cache rows that hold residual blobs, rebuilt into a small 16-bit scratch ring just before
the verify wave that reads them."""
from __future__ import annotations

import torch

from specter.errors import SpecterError

SCRATCH_ROWS = 8  # 16-bit rows a verify wave's coded experts are rebuilt into (a wave holds at most this many)


def coded_rows(slots: int, spare_rows: int, num_layers: int, num_experts: int, expert_bytes: int,
               blob_row_bytes: int, scratch: int = SCRATCH_ROWS) -> tuple[int, int, int]:
    """(coded slots per layer, coded spare rows, scratch rows) in the memory of `slots` 16-bit slots per layer and
    `spare_rows` 16-bit spare rows: `scratch` 16-bit rows for the rebuild (fewer where the memory would not keep a
    coded slot per layer), the rest as rows of the longest blob."""
    for rebuild in range(scratch, 0, -1):
        rows = (num_layers * slots + spare_rows - rebuild) * expert_bytes // blob_row_bytes
        own = min(slots * expert_bytes // blob_row_bytes, num_experts, max(rows, 0) // num_layers)
        if own >= 1:
            return own, rows - num_layers * own, rebuild
    need = (num_layers * blob_row_bytes + expert_bytes) / expert_bytes
    raise SpecterError(f"coded slots need the memory of at least {need:.1f} 16-bit experts ({num_layers} coded rows "
                       f"and a scratch row); this cache has {num_layers * slots + spare_rows}")


class CodedSlots:
    """The device memory of a cache whose slots hold residual blobs: `rows` blob rows of the longest blob's words
    (int32), and `scratch` 16-bit rows that `rebuild` decodes a wave's experts into, on the compute stream, so
    that the wave's kernel reads them after it and the next wave's rebuild overwrites them after that kernel
    (stream order: no event guards the scratch rows)."""

    def __init__(self, residuals, rows: int, scratch: int, numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.residuals, self.capacity, self.numel = residuals, residuals.max_blob_words, numel
        self.blobs = torch.empty(rows, self.capacity, dtype=torch.int32, device=device)  # [rows, longest blob]
        self.blob_rows = self.blobs.unbind(0)
        self.scratch = torch.empty(scratch, numel, dtype=dtype, device=device)  # [scratch, 3*I*H]
        self.scratch_rows = self.scratch.unbind(0)
        self.launcher = residuals.launcher()  # None off CUDA: the torch reference decodes

    @property
    def device_bytes(self) -> int:
        return self.blobs.numel() * 4 + self.scratch.numel() * self.scratch.element_size()

    def copy_in(self, streams, row: int, layer: int, expert: int, **waits):
        """The expert's blob into blob row `row` (a plain copy: nothing decodes it yet); its ready event."""
        blob = self.residuals.blob(layer, expert)
        return streams.copy(self.blob_rows[row][:blob.numel()], blob, **waits)

    def rebuild(self, streams, layer: int, wave: list[tuple[int, int]]) -> list[int]:
        """The exact 16-bit weights of a wave's experts ((expert, blob row) pairs, their copies waited for) in
        scratch rows 0.. in order, one decode launch on the current stream; the scratch rows."""
        if len(wave) > len(self.scratch_rows):
            raise ValueError(f"a wave of {len(wave)} coded experts exceeds the {len(self.scratch_rows)} scratch rows")
        words = [self.residuals.blob(layer, expert).numel() for expert, _ in wave]
        if self.launcher is None:
            streams.timed_decode(lambda: [self.residuals.decode(layer, expert, None, self.blob_rows[row][:n], out)
                                          for out, (expert, row), n in zip(self.scratch_rows, wave, words)])
        else:
            table = [(row * self.capacity, n, expert, i * self.numel) for i, ((expert, row), n) in
                     enumerate(zip(wave, words))]  # [n, 4]: blob offset, blob words, expert, output offset
            items = streams.upload_rows(table, 4, ring="coded")
            streams.timed_decode(lambda: self.residuals.decode_group(layer, self.launcher, self.blobs.view(-1),
                                                                     self.scratch, items))
        return list(range(len(wave)))

    def free(self) -> None:
        """Drop the device buffers (the caller has synchronised)."""
        self.blobs = torch.empty(0, self.capacity, dtype=torch.int32, device=self.blobs.device)  # no view: freed
        self.scratch = torch.empty(0, self.numel, dtype=self.scratch.dtype, device=self.scratch.device)
        self.blob_rows, self.scratch_rows = (), ()
        if self.launcher is not None:
            self.launcher.unbind()
