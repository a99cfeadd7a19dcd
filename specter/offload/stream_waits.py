"""Stream waits without the redundant ones: a stream never waits twice for one event, nor for its own events."""
from __future__ import annotations

# Events remembered per stream: the latest ones it waited for or recorded (enough for a verify layer's
# loads and waves, which wait for events a few launches old).
REMEMBERED_EVENTS = 64
REMEMBERED_STREAMS = 8  # stream objects remembered (the offload runtime's own three and recent current streams)


class StreamWaits:
    """`wait(stream, event)` makes `stream` wait for `event` unless the stream is already known to be past it:
    it waited for that event before, the event was recorded on it, or the event has completed (`mark_past`).
    Either makes a second wait a no-op on the GPU, while it costs the host a CUDA call. This holds because
    every event the offload runtime waits for is recorded once (a fresh event per copy, decode, release and
    upload) before any wait for it or query of it (CUDA calls an event never recorded done; a pending
    decode group is launched before anything waits for its event).

    What is remembered is kept per stream object (the runtime keeps its streams' objects, and the current
    stream's while it stays current), for the latest REMEMBERED_STREAMS objects, each with its latest
    REMEMBERED_EVENTS events; an entry holds its stream object, so no other object can take its id while
    the entry exists. Forgetting only costs a wait that was not needed."""

    def __init__(self) -> None:
        self.past: dict[int, tuple] = {}  # id(stream) -> (stream, {event: None} oldest first)
        self.skipped = 0  # waits not issued

    def wait(self, stream, event) -> None:
        """`stream.wait_event(event)` unless `stream` is past `event` (None: nothing to wait for)."""
        if event is None:
            return
        past = self._events(stream)
        if event in past:
            self.skipped += 1
            return
        stream.wait_event(event)
        self._remember(past, event)

    def mark_past(self, stream, event) -> None:
        """`stream`'s later work is past `event`: it was just recorded on the stream, or it has completed."""
        self._remember(self._events(stream), event)

    def is_past(self, stream, event) -> bool:
        entry = self.past.get(id(stream))
        return entry is not None and event in entry[1]

    def needs_wait(self, stream, event) -> bool:
        """Is `stream` not yet known to be past `event`? (False counts as a wait spared.)"""
        if self.is_past(stream, event):
            self.skipped += 1
            return False
        return True

    def _events(self, stream) -> dict:
        entry = self.past.get(id(stream))
        if entry is None:
            entry = self.past[id(stream)] = (stream, {})
            if len(self.past) > REMEMBERED_STREAMS:
                del self.past[next(iter(self.past))]
        return entry[1]

    @staticmethod
    def _remember(past: dict, event) -> None:
        past[event] = None
        if len(past) > REMEMBERED_EVENTS:
            del past[next(iter(past))]
