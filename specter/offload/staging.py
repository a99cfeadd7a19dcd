"""Staging rows: device memory for residual blobs between their copy and their decode; blobs that lie end to end
in both memories cross as one copy."""
from __future__ import annotations

import torch


class StagingRows:
    """Device rows for residual blobs between their copy and their decode, made on first use and again for a
    longer blob (`allocate`); per row, the event of the decode that read it last (`reader`, None before any),
    which a copy into the row waits for. A blob takes a row of its own, the next in turn (`take`), or, packed
    (`pack`), the words right after the previous packed blob, so that blobs copied back to back from adjacent
    host memory lie end to end here too and cross as one copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None  # [rows, capacity]
        self.flat: torch.Tensor | None = None  # the same words, one row after the other
        self.rows: tuple = ()  # each row's view, made once
        self.reader: list = []
        self.next_row = 0
        self.end: int | None = None  # word just past the last packed blob; None: the next one starts a row

    def fits(self, capacity: int) -> bool:
        return self.buffer is not None and self.buffer.shape[1] >= capacity

    def allocate(self, count: int, capacity: int, dtype: torch.dtype) -> None:
        """`count` rows of `capacity` elements (the old rows are dropped: nothing may still use them)."""
        self.buffer = torch.empty(count, capacity, dtype=dtype, device=self.device)
        self.flat, self.rows, self.reader = self.buffer.view(-1), self.buffer.unbind(0), [None] * count
        self.next_row, self.end = 0, None

    def take(self) -> int:
        """The next row, in turn (packing starts again at a row of its own afterwards)."""
        row, self.end = self.next_row, None
        self.next_row = (row + 1) % len(self.rows)
        return row

    def pack(self, words: int) -> tuple[int, range, range]:
        """(word offset, rows reached, rows reached first): the place of a blob of `words` words right after the
        previous packed one, or at the start of the next row when it would pass the buffer's end or packing was
        closed (`close`, `take`); the rows it reaches that the previous packed blob did not are for the caller to
        wait for their readers."""
        count, width = self.buffer.shape
        if self.end is not None and self.end + words <= count * width:
            start, first = self.end, (self.end - 1) // width + 1
        else:
            start, first = self.next_row * width, self.next_row
        last = (start + words - 1) // width
        self.end, self.next_row = start + words, (last + 1) % count
        return start, range(start // width, last + 1), range(first, last + 1)

    def close(self) -> None:
        """The next packed blob starts a row of its own (a row is never shared by two decodes)."""
        self.end = None

    def offset(self, row: int) -> int:
        """Word offset of `row`'s start in the flat buffer."""
        return row * self.buffer.shape[1]

    def span(self, offset: int, words: int) -> torch.Tensor:
        """`words` words from word `offset` of the flat buffer."""
        return self.flat[offset:offset + words]

    def copy_pairs(self, copies: list[tuple[int, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs for blobs placed at word offsets: each run of blobs that continue one
        another here and in one host buffer (neighbouring experts of a layer) as one pair spanning them."""
        runs = []  # [offset, words, first blob]
        for offset, blob in copies:
            if runs and _continues(runs[-1], offset, blob):
                runs[-1][1] += blob.numel()
            else:
                runs.append([offset, blob.numel(), blob])
        return [(self.span(offset, words), blob if blob.numel() == words else blob.as_strided((words,), (1,)))
                for offset, words, blob in runs]

    def view(self, row: int, words: int) -> torch.Tensor:
        """The first `words` elements of `row`."""
        return self.rows[row][:words]


def _continues(run: list, offset: int, blob: torch.Tensor) -> bool:
    """Does `blob`, placed at word `offset`, continue `run` ([offset, words, first blob]) in both memories?"""
    start, words, first = run
    return (offset == start + words and blob.dtype == first.dtype
            and blob.data_ptr() == first.data_ptr() + words * first.element_size()
            and blob.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
