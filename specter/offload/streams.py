"""Streams and events of the offload runtime: a compute stream, a dedicated H2D copy stream, readiness events."""
from __future__ import annotations

import time

import torch

from specter.offload.copy_log import CopyLog, CopyRecord
from specter.offload.decode_groups import DecodeGroup, PendingDecodes
from specter.offload.host_reads import HostRead, HostTap, read_when_reached
from specter.offload.staging import StagingRows
from specter.offload.stream_waits import StreamWaits
from specter.offload.uploads import UploadRings

# The current stream's identity without building a Stream object (what torch.cuda.current_stream reads).
_current_stream_of = getattr(torch._C, "_cuda_getCurrentStream", None)
STAGING_BYTES = 128 * 2**20  # device memory for residual blobs between their copy and their decode
MIN_STAGING_BUFFERS = 2  # at least one blob in flight while one decodes


class DeviceStreams:
    """All stream/event handling of expert I/O lives here.

    On CUDA: copies go to a dedicated copy stream (pinned source, non_blocking), each copy first waits
    for the destination row's last-use event and records a ready event; compute waits on ready events
    with `wait_event` (no host synchronisation), through `waits` (`StreamWaits`: no stream waits twice for
    one event, nor for its own). On CPU everything is synchronous and events are None.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # an indexed device keeps current_stream() off torch's slow
            self.device = torch.device("cuda", torch.cuda.current_device())  # device lookup (per call)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.decode_stream = torch.cuda.Stream(self.device) if self.cuda else None  # residual decodes
        self.group_copies = False  # a decode group's blob copies are issued together, when its decode launches
        self.staging = StagingRows(self.device)  # residual blobs between their copy and their decode
        self._newest_decode = None  # ready event of the last decode launched (decodes run in order on one stream)
        self._pending: PendingDecodes | None = None  # grouped residual loads not decoded yet
        self.log = CopyLog()  # copies, stalls and decodes since `reset_stats`
        self._flush_host_ms = 0.0  # host time launching decode groups (`flush_decodes`), wherever called from
        self._current = (None, None)  # the current stream's (id triple, Stream object), `compute_stream`
        self.waits = StreamWaits()  # every stream wait goes through it: none issued twice
        self._skipped_before = 0  # waits it had spared at the last `reset_stats`
        self.uploads = UploadRings(self.device, self.compute_stream if self.cuda else None)

    def record(self):
        """An event on the compute stream marking work enqueued so far (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.compute_stream())
        return event

    def compute_stream(self):
        """The stream decoding runs on (the current one; its Stream object is reused while it stays current)."""
        if _current_stream_of is None:
            return torch.cuda.current_stream(self.device)
        current = _current_stream_of(self.device.index)  # (stream id, device index, device type)
        if current != self._current[0]:
            self._current = (current, torch.cuda.current_stream(self.device))
        return self._current[1]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, demand: bool = False, previous=None):
        """dst <- src on the copy stream once `after` (dst's row's last use) has passed; returns its ready event.

        On CPU the copy is synchronous; a `demand` copy (compute is waiting for it) counts as a stall.
        """
        nbytes = src.numel() * src.element_size()
        if not self.cuda:
            self._on_host(lambda: dst.copy_(src), nbytes, demand)
            return None
        if self._pending is not None and self._pending.holds(after, previous):
            self.flush_decodes()
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self.copy_stream
        self.waits.wait(stream, after)
        self._issue_copy(dst, src, stream, start, ready)
        self.log.copies.append(CopyRecord(start, ready, nbytes, after))
        return ready

    def copy_in_order(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src on the compute stream, after the kernels issued so far and before those issued next (no
        event orders it), timed and logged as a copy and as the compute stall it is; synchronous on CPU."""
        nbytes = src.numel() * src.element_size()
        if not self.cuda:
            self._on_host(lambda: dst.copy_(src), nbytes, demand=True)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self.compute_stream()
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        self.log.copies.append(CopyRecord(start, end, nbytes))
        self.log.stalls.append((start, end, (end,)))

    def _issue_copy(self, dst: torch.Tensor, src: torch.Tensor, stream, start, end) -> None:
        self._issue_copies([(dst, src)], stream, start, end)

    def _issue_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream, start, end) -> None:
        """dst <- src for each (dst, src) on `stream`, back to back between the events `start` and `end`
        (torch's copy_ with `stream` made current for them)."""
        compute = self.compute_stream()
        torch.cuda.set_stream(stream)  # not `with torch.cuda.stream(...)`: it looks the device up twice per copy
        try:
            start.record(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        finally:
            torch.cuda.set_stream(compute)

    def copy_decoded(self, dst: torch.Tensor, blob: torch.Tensor, decode, capacity: int, after=None,
                     demand: bool = False, previous=None, group: DecodeGroup | None = None, member=None):
        """dst <- decode(blob on the device, dst) (a residual load); returns its ready event.

        The blob crosses PCIe on the copy stream into a staging row of `capacity` elements (the longest
        blob; as many rows as STAGING_BYTES holds, at least MIN_STAGING_BUFFERS, each reused once the
        decode that read it has ended), without waiting for dst's row: the decode stream waits for the blob,
        for `after` (the row's last use) and `previous` (the row's last copy), then decodes into dst.
        With a `group`, the decode joins the pending group of its key instead (`member` travels with it),
        launched by `group.launch` once `group.size` loads are in it, or when anything needs one of them
        (`flush_decodes`); every load of a group returns the group's ready event. With `group_copies` a
        grouped load's blob copy waits in the group too, and the launch issues the group's copies back to back
        first (`_issue_deferred_copies`).
        On CPU `decode` reads the host blob directly, synchronously.
        """
        nbytes = blob.numel() * blob.element_size()
        if not self.cuda:
            span = self._on_host(lambda: decode(blob, dst), nbytes, demand)
            self.log.decodes.append(span)
            return None
        self._ensure_staging(capacity, blob.dtype)
        if group is not None and self.group_copies:
            return self._defer_copy(group, blob, (dst, member), (after, previous))
        row, pending = self.staging.take(), self._pending
        if pending is not None and (group is None or pending.group.key != group.key or row in pending.rows
                                    or pending.holds(after, previous)):
            self.flush_decodes()
        start, arrived = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.waits.wait(self.copy_stream, self.staging.reader[row])  # the decode that read this row last
        staged = self.staging.view(row, blob.numel())
        self._issue_copy(staged, blob, self.copy_stream, start, arrived)
        if group is None:
            ready = self._decode_now(decode, staged, dst, (arrived, after, previous))
        else:
            ready = self._join_group(group, (self.staging.offset(row), blob.numel(), dst, member),
                                     (arrived, after, previous))
            self._pending.rows[row] = None
        self.staging.reader[row] = ready
        self.log.copies.append(CopyRecord(start, arrived, nbytes, after))
        if self._pending is not None and len(self._pending.items) >= self._pending.group.size:
            self.flush_decodes()
        return ready

    def _ensure_staging(self, capacity: int, dtype: torch.dtype) -> None:
        """Staging rows of at least `capacity` elements (allocated once per capacity, after the pending decodes)."""
        if not self.staging.fits(capacity):
            self.flush_decodes()
            count = max(MIN_STAGING_BUFFERS, STAGING_BYTES // (capacity * dtype.itemsize))
            self.staging.allocate(count, capacity, dtype)

    def timed_decode(self, work) -> None:
        """Run `work` (decode launches on the current stream, in stream order) timed into the decode log."""
        if not self.cuda:
            start = time.perf_counter()
            work()
            span = (start, time.perf_counter())
        else:
            stream = self.compute_stream()
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            span[0].record(stream)
            work()
            span[1].record(stream)
        self.log.decodes.append(span)
        self.log.rebuilds.append(span)

    def _decode_now(self, decode, staged: torch.Tensor, dst: torch.Tensor, waits: tuple):
        """One load's decode on the decode stream after `waits`; its ready event."""
        decoding, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        compute = self.compute_stream()
        torch.cuda.set_stream(self.decode_stream)
        try:
            for event in waits:
                self.waits.wait(self.decode_stream, event)
            decoding.record(self.decode_stream)
            decode(staged, dst)
            ready.record(self.decode_stream)
            self._newest_decode = ready
            self.waits.mark_past(self.decode_stream, ready)
        finally:
            torch.cuda.set_stream(compute)
        self.log.decodes.append((decoding, ready))
        return ready

    def _defer_copy(self, group: DecodeGroup, blob: torch.Tensor, target: tuple, row_events: tuple):
        """A grouped load with `group_copies`: its blob, packed after the group's previous one in staging
        (`StagingRows.pack`), waits in the pending group with the decode (copied by `_issue_deferred_copies`);
        the group's ready event."""
        pending = self._pending
        if pending is not None and (pending.group.key != group.key or pending.holds(*row_events)):
            self.flush_decodes()
        words = blob.numel()
        offset, reached, new = self.staging.pack(words)
        if new and self._pending is not None and not self._pending.rows.keys().isdisjoint(new):
            self.flush_decodes()  # the ring came round to the group's own rows: they are decoded first
            offset, reached, new = self.staging.pack(words)
        ready = self._join_group(group, (offset, words, *target), (None, *row_events))
        pending, reader = self._pending, self.staging.reader
        for row in new:  # the rows it reaches first: their readers before the group, then the group's decode
            pending.rows[row], reader[row] = reader[row], ready
        pending.copies.append((offset, blob, tuple(map(pending.rows.__getitem__, reached))))  # shared rows too
        if len(pending.items) >= group.size:
            self.flush_decodes()
        return ready

    def start_copies(self) -> None:
        """Issue the pending group's deferred copies now (`group_copies`; its decode still waits for the group
        to fill or be needed): before the host blocks or leaves a layer, so the copy stream has them."""
        if self._pending is not None and self._pending.copies:
            self._issue_deferred_copies(self._pending)

    def _issue_deferred_copies(self, pending: PendingDecodes) -> None:
        """The pending group's blob copies, back to back on the copy stream after the decodes that last read their
        staging rows (a wait per distinct reader): first into rows an older decode read, then into those of the
        newest decode, likely still running, so that the copy stream does not idle behind it while rows are free.
        One pair of timing records per batch."""
        newest = self._newest_decode
        older, behind = [], []
        for copy in pending.copies:  # events compare by identity
            (behind if newest is not None and newest in copy[2] else older).append(copy)
        for batch in filter(None, (older, behind)):
            for event in dict.fromkeys(reader for *_, readers in batch for reader in readers if reader is not None):
                self.waits.wait(self.copy_stream, event)
            start, arrived = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pairs = self.staging.copy_pairs([(offset, blob) for offset, blob, _ in batch])
            self._issue_copies(pairs, self.copy_stream, start, arrived)
            nbytes = sum(blob.numel() * blob.element_size() for _, blob, _ in batch)
            self.log.copies.append(CopyRecord(start, arrived, nbytes, copies=len(batch), calls=len(pairs)))
            pending.arrived = arrived  # the copy stream runs in order: the last batch's arrival covers the others
        pending.copies = []

    def _join_group(self, group: DecodeGroup, item: tuple, waits: tuple):
        if self._pending is None:
            self._pending = PendingDecodes(group)
        pending = self._pending
        arrived, *row_events = waits
        pending.items.append(item)
        if arrived is not None:  # None: a deferred copy (its arrival is recorded when it is issued)
            pending.arrived = arrived  # the copy stream runs in order: the last blob's arrival covers the others
        pending.waits += [event for event in row_events if event is not None]
        return pending.ready

    def flush_decodes(self) -> None:
        """Launch the pending group's decode (if any) on the decode stream, after every event it waits for."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start = time.perf_counter()
        self._launch_group(pending)
        self._flush_host_ms += (time.perf_counter() - start) * 1e3

    def _launch_group(self, pending: PendingDecodes) -> None:
        """A pending group's deferred copies (if any), then its decode on the decode stream after its events."""
        if pending.copies:
            self._issue_deferred_copies(pending)
        decoding, compute = torch.cuda.Event(enable_timing=True), self.compute_stream()
        try:
            torch.cuda.set_stream(self.decode_stream)
            for event in [pending.arrived, *pending.waits]:
                self.waits.wait(self.decode_stream, event)
            decoding.record(self.decode_stream)
            pending.group.launch(self.staging.buffer, pending.items)
            self.staging.close()  # the next group's blobs start a row of their own
            pending.ready.record(self.decode_stream)
            self._newest_decode = pending.ready
            self.waits.mark_past(self.decode_stream, pending.ready)
        finally:
            torch.cuda.set_stream(compute)
        self.log.decodes.append((decoding, pending.ready))

    def _on_host(self, work, nbytes: int, demand: bool) -> tuple[float, float]:
        """A copy on CPU: `work` now, timed and recorded (a `demand` copy as a stall too); its span."""
        start = time.perf_counter()
        work()
        span = (start, time.perf_counter())
        self.log.copies.append(CopyRecord(*span, nbytes))
        if demand:
            self.log.stalls.append((*span, ()))
        return span

    def wait(self, ready) -> None:
        """Make the compute stream wait for a copy (no host sync); the stall is timed with two events."""
        self.wait_all([ready])

    def wait_all(self, events: list) -> None:
        """`wait` for several copies (one launch's experts), each event once and only where the compute stream is
        not past it yet (`StreamWaits`) and it has not finished: one timed stall for them."""
        if self._pending is not None and self._pending.holds(*events):
            self.flush_decodes()  # an unrecorded event would not hold the compute stream back
        if not self.cuda:
            return  # CPU: copies are synchronous, there is nothing to wait for
        stream = self.compute_stream()
        pending = [event for event in dict.fromkeys(events) if event is not None
                   and self.waits.needs_wait(stream, event) and not self._passed(stream, event)]
        if not pending:
            return
        before = self.record()
        for event in pending:
            self.waits.wait(stream, event)
        self.log.stalls.append((before, self.record(), tuple(pending)))

    def _passed(self, stream, event) -> bool:
        """Has `event` completed (then `stream` is marked past it)?"""
        if not event.query():
            return False
        self.waits.mark_past(stream, event)
        return True

    def read_later(self, tensor: torch.Tensor) -> HostRead:
        """Start copying a small device tensor to the host now (pinned, async); `.result()` waits for that
        copy alone, so work enqueued after this call keeps the GPU busy while the host waits."""
        return read_when_reached(tensor) if self.cuda else HostRead(tensor, None)  # queued on the compute stream

    def upload_map(self, size: int, entries: list[tuple[int, int]], ring: str = "maps") -> torch.Tensor:
        """[size] int64 on the device, v at i for each (i, v) of `entries`, -1 elsewhere (`UploadRings.upload_map`)."""
        return self.uploads.upload_map(size, entries, ring)

    def upload_rows(self, rows: list[tuple[int, ...]], width: int, ring: str = "rows") -> torch.Tensor:
        """[len(rows), width] int64 on the device from `rows` (`UploadRings.upload_rows`)."""
        return self.uploads.upload_rows(rows, width, ring)

    def tap(self, shape: tuple, dtype: torch.dtype) -> HostTap | None:
        """A fixed pinned host buffer that `HostTap.record` fills from inside a CUDA graph, or None where
        a captured graph cannot signal the host (this torch has no external events)."""
        try:
            return HostTap(shape, dtype, self.cuda)
        except TypeError:  # torch.cuda.Event(external=...) is missing
            return None

    @staticmethod
    def is_ready(ready) -> bool:
        """Non-blocking: has this copy finished (always True on CPU)?"""
        return ready is None or ready.query()

    def synchronize(self) -> None:
        """Host waits for compute and copies (only between requests, never on the decode path)."""
        if self.cuda:
            self.flush_decodes()
            self.compute_stream().synchronize()
            self.copy_stream.synchronize()
            self.decode_stream.synchronize()

    def reset_stats(self) -> None:
        self.log.reset()
        self._flush_host_ms = 0.0
        self._skipped_before = self.waits.skipped
        self.uploads.reset_stats()

    def stats(self) -> dict:
        """H2D bytes, copy busy time, achieved GB/s and compute stall time (the host waits here, once)."""
        self.synchronize()
        return {
            **self.log.stats(self.copied_bytes()),
            "residual_group_host_ms": self._flush_host_ms,  # launching decode groups (their tables' uploads included)
            "upload_wait_ms": self.uploads.wait_ms,  # the host waiting for an upload ring's buffer to come free
            "stream_waits_skipped": self.waits.skipped - self._skipped_before,  # waits spared (no CUDA call)
        }

    def copied_bytes(self) -> int:
        """Bytes of the copies issued since `reset_stats`, deferred ones included (host bookkeeping, no sync)."""
        deferred = 0 if self._pending is None else self._pending.deferred_bytes()
        return self.log.copied_bytes() + deferred

    def copy_spans_ms(self, timeline) -> list[tuple[float, float, float | None]]:
        """(start, end, slot free) of every copy since `reset_stats`, in ms on `timeline` (after decoding: it
        waits); slot free: when the event the copy waited for (its row's last use) passed, None if none."""
        self.synchronize()
        return self.log.spans_ms(lambda event: None if event is None else timeline.offset_ms(event, wait=False))

    def critical_path_ms(self, timeline) -> tuple[list[tuple[float, float, float]], list[tuple[float, float]]]:
        """The compute stream's stalls split into waiting for copies and for rebuilds, and its own rebuilds, in
        ms on `timeline` (CopyLog.critical_path_ms; after decoding: it waits)."""
        self.synchronize()
        return self.log.critical_path_ms(lambda event: timeline.offset_ms(event, wait=False))

    def measured_bandwidth(self) -> float | None:
        """Bytes per ms over the last copies that have finished (non-blocking), or None if none has."""
        return self.log.measured_bandwidth(lambda c: self.is_ready(c.end if self.cuda else None))
