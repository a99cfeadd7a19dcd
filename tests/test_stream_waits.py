"""StreamWaits: a stream never waits twice for one event, nor for an event recorded on it or completed."""
import pytest

from specter.offload import stream_waits
from specter.offload.stream_waits import StreamWaits


class Stream:
    def __init__(self) -> None:
        self.waited = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_a_second_wait_for_one_event_is_skipped_and_counted():
    waits, stream, event = StreamWaits(), Stream(), object()
    waits.wait(stream, event)
    waits.wait(stream, event)
    waits.wait(stream, None)
    assert stream.waited == [event] and waits.skipped == 1


def test_streams_are_apart_and_an_event_marked_past_is_not_waited_for():
    waits, copy, decode = StreamWaits(), Stream(), Stream()
    ready, arrived = object(), object()
    waits.mark_past(decode, ready)  # recorded on the decode stream
    waits.wait(decode, ready)
    waits.wait(copy, ready)  # another stream still waits
    waits.wait(decode, arrived)
    assert decode.waited == [arrived] and copy.waited == [ready]
    assert waits.is_past(copy, ready) and waits.is_past(decode, arrived) and not waits.is_past(copy, arrived)
    assert not waits.needs_wait(decode, ready) and waits.needs_wait(copy, arrived) and waits.skipped == 2


def test_only_the_latest_events_and_streams_are_remembered(monkeypatch):
    monkeypatch.setattr(stream_waits, "REMEMBERED_EVENTS", 3)
    monkeypatch.setattr(stream_waits, "REMEMBERED_STREAMS", 2)
    waits, stream = StreamWaits(), Stream()
    events = [object() for _ in range(4)]
    for event in events:
        waits.wait(stream, event)
    waits.wait(stream, events[0])  # forgotten: waited again (a wait too many, never one too few)
    waits.wait(stream, events[3])
    assert stream.waited == events + [events[0]]
    others = [Stream(), Stream()]
    for other in others:
        waits.wait(other, events[1])
    assert not waits.is_past(stream, events[3])  # the oldest stream's entry is dropped
    assert len(waits.past) == 2


@pytest.mark.parametrize("repeat", [1, 2])
def test_every_skipped_wait_was_redundant(repeat):
    """Random waits and records on three streams: a wait is skipped only where the stream waited for the event
    or recorded it before."""
    import random

    rng, waits = random.Random(repeat), StreamWaits()
    streams, events, seen = [Stream() for _ in range(3)], [object() for _ in range(20)], set()
    for _ in range(400):
        stream, event = rng.choice(streams), rng.choice(events)
        if rng.random() < 0.3:
            waits.mark_past(stream, event)
            seen.add((id(stream), id(event)))
            continue
        before = len(stream.waited)
        waits.wait(stream, event)
        if len(stream.waited) == before:
            assert (id(stream), id(event)) in seen
        seen.add((id(stream), id(event)))
