"""Grouped residual decodes in DeviceStreams (DECODE_GROUP loads a launch), on CPU through fake CUDA streams and events.

The fakes keep a log of what each stream is asked to do and fail on a wait for an event nobody recorded
(real CUDA would let such a wait pass at once: the race these tests guard against).
"""
import random

import pytest
import torch

import specter.offload.streams as streams_module
from specter.offload.decode_groups import DecodeGroup
from specter.offload.streams import DeviceStreams


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.stream = None
        LOG.append(("event", None, self))

    def record(self, stream=None) -> None:
        self.stream = stream
        LOG.append(("record", stream.name if stream else None, self))

    def query(self) -> bool:
        return False  # still running on the device

    def elapsed_time(self, other) -> float:
        return 0.0

    def synchronize(self) -> None:
        pass


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event) -> None:
        assert event.stream is not None, f"{self.name} waits for an event that was never recorded"
        LOG.append(("wait", self.name, event))

    def synchronize(self) -> None:
        pass


LOG: list = []
COMPUTE = FakeStream("compute")


@pytest.fixture
def streams(monkeypatch):
    """DeviceStreams on CPU memory with fake CUDA streams and events (copies run synchronously)."""
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: COMPUTE)
    streams = DeviceStreams(torch.device("cpu"))
    streams.cuda = True
    streams.copy_stream, streams.decode_stream = FakeStream("copy"), FakeStream("decode")
    return streams


def launches() -> list:
    return [entry for entry in LOG if entry[0] == "launch"]


def grouped(key, size: int = 3) -> DecodeGroup:
    """A group whose launch writes each blob into its destination (the plumbing, not the residual decode)."""
    def launch(staging: torch.Tensor, items: list) -> None:
        LOG.append(("launch", key, [member for *_, member in items]))
        for offset, words, dst, _ in items:
            dst[:words] = staging.view(-1)[offset:offset + words]
    return DecodeGroup(key, size, launch)


def load(streams, dst, value: int, group, member, after=None, previous=None):
    blob = torch.full((5 + member,), value, dtype=torch.int32)
    return streams.copy_decoded(dst, blob, None, 16, after=after, previous=previous, group=group, member=member)


@pytest.fixture
def rows():
    return torch.zeros(6, 16, dtype=torch.int32)


def test_a_full_group_launches_once_with_every_load(streams, rows):
    group = grouped("layer0", size=3)
    events = [load(streams, rows[i], 10 + i, group, member=i) for i in range(3)]
    assert launches() == [("launch", "layer0", [0, 1, 2])]
    assert events[0] is events[1] is events[2] and events[0].stream.name == "decode"
    for i in range(3):
        assert rows[i, :5 + i].eq(10 + i).all() and not rows[i, 5 + i:].any()
    assert streams.stats()["residual_decodes"] == 1 and streams.stats()["h2d_copies"] == 3


def test_a_wait_for_a_pending_load_launches_its_group_first(streams, rows):
    group = grouped("layer0", size=8)
    ready = load(streams, rows[0], 7, group, member=0)
    load(streams, rows[1], 8, group, member=1)
    assert launches() == [] and ready.stream is None
    streams.wait_all([ready])
    assert launches() == [("launch", "layer0", [0, 1])]
    assert ("wait", "compute", ready) in LOG and LOG.index(("wait", "compute", ready)) > LOG.index(launches()[0])


def test_another_layer_a_pending_row_or_an_ungrouped_load_closes_the_group(streams, rows):
    first, second = grouped("layer0", size=8), grouped("layer1", size=8)
    ready = load(streams, rows[0], 1, first, member=0)
    load(streams, rows[1], 2, second, member=1)  # another layer
    assert launches() == [("launch", "layer0", [0])]
    pending = load(streams, rows[2], 3, second, member=2)
    load(streams, rows[3], 4, second, member=3, previous=pending)  # that row's last copy is in the group
    assert launches()[1:] == [("launch", "layer1", [1, 2])]
    streams.copy_decoded(rows[4], torch.ones(5, dtype=torch.int32), lambda blob, dst: dst[:5].copy_(blob), 16)
    assert launches()[2:] == [("launch", "layer1", [3])] and rows[4, :5].eq(1).all()
    assert ready.stream.name == "decode"


def test_staging_rows_are_not_reused_by_a_pending_group(streams, rows, monkeypatch):
    monkeypatch.setattr(streams_module, "STAGING_BYTES", 1)  # the minimum: two staging rows
    group = grouped("layer0", size=8)
    load(streams, rows[0], 1, group, member=0)
    load(streams, rows[1], 2, group, member=1)
    assert launches() == []
    load(streams, rows[2], 3, group, member=2)  # staging row 0 again: its group decodes first
    assert launches() == [("launch", "layer0", [0, 1])]
    streams.synchronize()  # flushes what is left
    assert launches()[1:] == [("launch", "layer0", [2])]
    assert [int(rows[i, 0]) for i in range(3)] == [1, 2, 3]


def test_a_group_of_four_makes_fewer_events_and_launches_per_load(streams, rows):
    """What grouping saves on the host: events and decode launches per load (the copies stay one each)."""
    decoded = []
    single = [streams.copy_decoded(rows[i], torch.ones(5, dtype=torch.int32), lambda blob, dst: decoded.append(dst), 16)
              for i in range(4)]
    events_single = sum(entry[0] == "event" for entry in LOG)
    assert len(set(map(id, single))) == 4 and len(decoded) == 4
    assert events_single == 4 * 4  # start, arrived, decoding, ready per load
    LOG.clear()
    group = grouped("layer0", size=4)
    for i in range(4):
        load(streams, rows[i], i, group, member=i)
    assert sum(entry[0] == "event" for entry in LOG) == 4 * 2 + 2  # start, arrived per load; 2 per group
    assert len(launches()) == 1


def waits(stream: str) -> list:
    return [event for kind, name, event in LOG if kind == "wait" and name == stream]


def test_a_shared_ready_event_is_waited_for_once_and_a_decode_stream_event_not_by_the_decode_stream(streams, rows):
    """Two waves on one group's loads: the compute stream waits for its ready event once. A group whose rows
    were last filled by an earlier group's decode does not make the decode stream wait for that decode."""
    group = grouped("layer0", size=8)
    first = [load(streams, rows[i], i, group, member=i) for i in range(2)]
    streams.wait_all(first[:1])
    streams.wait_all(first)  # the same event again: already waited for
    assert waits("compute") == [first[0]] and first[0] is first[1]
    load(streams, rows[2], 9, group, member=2, previous=first[0])  # that row's last copy: decoded on "decode"
    streams.flush_decodes()
    assert first[0] not in waits("decode") and streams.stats()["stream_waits_skipped"] >= 2

def test_freeing_a_cache_runs_its_pending_decodes_first(streams, rows):
    """A pool is dropped only once nothing still writes into it."""
    from specter.offload.eviction import RoutingCounts, make_policy
    from specter.offload.expert_cache import ExpertCache
    from specter.offload.host_store import HostExpertStore

    store = HostExpertStore(1, 2, 16, 16, torch.float32, torch.device("cpu"))
    cache = ExpertCache(store, 1, torch.device("cpu"), streams, make_policy("lru", RoutingCounts()), 0)
    load(streams, rows[0], 5, grouped("layer0", size=8), member=0)
    assert launches() == []
    cache.free()
    assert launches() == [("launch", "layer0", [0])] and cache.pool.numel() == 0


def copy_records() -> list:
    return [entry for entry in LOG if entry[0] == "record" and entry[1] == "copy"]


def test_group_copies_wait_in_the_group_and_cross_back_to_back_at_its_launch(streams, rows):
    """Grouped copies (residual transfer): nothing crosses before the launch; then every blob of the group between one
    start and one arrival record, before the decode stream waits for that arrival and launches."""
    streams.group_copies = True
    group = grouped("layer0", size=3)
    ready = [load(streams, rows[i], 20 + i, group, member=i) for i in range(2)]
    assert copy_records() == [] and not rows.any() and ready[0] is ready[1]
    assert streams.copied_bytes() == (5 + 6) * 4  # counted while deferred
    load(streams, rows[2], 22, group, member=2)
    _, arrived = (entry[2] for entry in copy_records())  # one start and one arrival for the three copies
    assert launches() == [("launch", "layer0", [0, 1, 2])]
    assert LOG.index(("wait", "decode", arrived)) < LOG.index(launches()[0])
    for i in range(3):
        assert rows[i, :5 + i].eq(20 + i).all() and not rows[i, 5 + i:].any()
    stats = streams.stats()
    assert stats["h2d_copies"] == 3 and stats["h2d_bytes"] == (5 + 6 + 7) * 4 and stats["residual_decodes"] == 1


def test_group_copies_make_four_events_per_group(streams, rows):
    streams.group_copies = True
    group = grouped("layer0", size=4)
    for i in range(4):
        load(streams, rows[i], i, group, member=i)
    assert sum(entry[0] == "event" for entry in LOG) == 4  # start, arrived, decoding, ready: none per load


def test_group_copies_wait_for_the_decode_that_last_read_a_staging_row(streams, rows, monkeypatch):
    monkeypatch.setattr(streams_module, "STAGING_BYTES", 1)  # two staging rows
    streams.group_copies = True
    group = grouped("layer0", size=2)
    first = load(streams, rows[0], 1, group, member=0)
    load(streams, rows[1], 2, group, member=1)  # packed after the first blob: both in staging row 0
    second = load(streams, rows[2], 3, group, member=2)
    load(streams, rows[3], 4, group, member=3)  # the second group: row 1
    assert [entry for entry in LOG if entry[0] == "wait" and entry[1] == "copy"] == []  # fresh rows
    load(streams, rows[4], 5, group, member=4)  # row 0 again, last read by the first group's decode
    load(streams, rows[5], 6, group, member=5)  # on into row 1, last read by the second group's decode
    waits = [entry for entry in LOG if entry[0] == "wait" and entry[1] == "copy"]
    assert waits == [("wait", "copy", first), ("wait", "copy", second)]  # one wait per decode
    older_start, newest_start = copy_records()[4][2], copy_records()[6][2]
    assert LOG.index(waits[0]) < LOG.index(("record", "copy", older_start)) < LOG.index(waits[1])
    assert LOG.index(waits[1]) < LOG.index(("record", "copy", newest_start))
    assert [int(rows[i, 0]) for i in range(6)] == [1, 2, 3, 4, 5, 6]


def test_group_copies_into_rows_the_running_decode_holds_cross_last(streams, rows, monkeypatch):
    """Three staging rows, groups of two blobs of a row each: the second group's blob for the fresh row crosses at
    once, the one for a row the first group's decode (the newest) still reads crosses after the copy stream waits
    for that decode, each batch timed by its own pair of records; the decode waits for the last batch's arrival."""
    monkeypatch.setattr(streams_module, "STAGING_BYTES", 3 * 16 * 4)  # three rows of 16 int32 words
    streams.group_copies = True
    group = grouped("layer0", size=2)
    first = [load(streams, rows[i], 1 + i, group, member=11) for i in range(2)]  # 16 words each: rows 0 and 1
    LOG.clear()
    load(streams, rows[2], 3, group, member=11)  # staging row 2: never read
    load(streams, rows[3], 4, group, member=11)  # staging row 0: read by the first group's decode
    records = copy_records()
    assert len(records) == 4 and waits("copy") == [first[0]]
    assert LOG.index(records[1]) < LOG.index(("wait", "copy", first[0])) < LOG.index(records[2])
    assert LOG.index(("wait", "decode", records[3][2])) < LOG.index(launches()[0])
    assert len(launches()) == 1 and [int(rows[i, 15]) for i in range(4)] == [1, 2, 3, 4]
    stats = streams.stats()
    assert stats["h2d_copies"] == 4 and stats["h2d_bytes"] == 4 * 16 * 4


def test_a_blob_packed_into_a_row_another_blob_took_waits_for_that_row_too(streams, rows, monkeypatch):
    """Two staging rows, both read by the newest decode: the next group's first blob takes row 0 and waits for that
    decode; the blobs packed after it in row 0 reach no new row, yet they cross after the same wait."""
    monkeypatch.setattr(streams_module, "STAGING_BYTES", 2 * 16 * 4)  # two rows of 16 int32 words
    streams.group_copies = True
    earlier = grouped("layer0", size=2)
    newest = load(streams, rows[0], 1, earlier, member=4)  # 9 words: row 0
    load(streams, rows[1], 2, earlier, member=5)  # 10 words: on into row 1
    LOG.clear()
    group = grouped("layer1", size=3)
    for i in range(3):
        load(streams, rows[2 + i], 3 + i, group, member=0)  # 5 words each, all three in row 0
    waited, first_record = LOG.index(("wait", "copy", newest)), LOG.index(copy_records()[0])
    assert waited < first_record and len(copy_records()) == 2  # one batch, after the wait
    assert [int(rows[i, 0]) for i in range(5)] == [1, 2, 3, 4, 5]


def test_group_copies_of_blobs_adjacent_on_the_host_cross_as_one_copy(streams, rows):
    """Blobs that lie end to end in one host buffer (consecutive experts of a layer) are packed end to end in
    staging too and cross in one copy call; each load still lands in its own destination."""
    streams.group_copies = True
    host = torch.arange(5 + 6 + 7 + 4, dtype=torch.int32)
    blobs = [host[0:5], host[5:11], host[11:18], host[18:22]]
    group = grouped("layer0", size=4)
    order = [0, 1, 3, 2]  # the third load's blob is not the second's neighbour: two runs
    for i, blob_index in enumerate(order):
        streams.copy_decoded(rows[i], blobs[blob_index], None, 16, group=group, member=blob_index)
    stats = streams.stats()
    assert stats["h2d_copies"] == 4 and stats["h2d_copy_calls"] == 3 and stats["h2d_bytes"] == host.numel() * 4
    for i, blob_index in enumerate(order):
        assert torch.equal(rows[i, :blobs[blob_index].numel()], blobs[blob_index])


@pytest.mark.parametrize("group_copies", [False, True])
@pytest.mark.parametrize("staging_rows", [2, 3, 5])
def test_every_staging_copy_waits_for_the_last_decode_of_its_row(streams, monkeypatch, group_copies, staging_rows):
    """Random grouped loads of two layers through a small staging ring, with waits on random loads and started
    copies: each copy into a staging row comes after a copy-stream wait for the decode that last read the row (or
    a later decode: they run in order on one stream), and every destination ends with its own blob."""
    monkeypatch.setattr(streams_module, "STAGING_BYTES", staging_rows * 16 * 4)  # rows of 16 int32 words
    streams.group_copies, rng = group_copies, random.Random(staging_rows)
    copied, read = [], {}  # (LOG position, staging rows) per copy as it is issued; launch position -> rows read
    view, span, width = streams.staging.view, streams.staging.span, 16

    def viewed(row, words):  # a copy's destination row, taken after its waits, just before it is issued
        copied.append((len(LOG), {row}))
        return view(row, words)

    def spanned(offset, words):  # a packed copy's destination
        copied.append((len(LOG), set(range(offset // width, (offset + words - 1) // width + 1))))
        return span(offset, words)

    def layer_group(key):
        def launch(staging, items):
            read[len(LOG)] = {row for offset, words, *_ in items
                              for row in range(offset // width, (offset + words - 1) // width + 1)}
            LOG.append(("launch", key, [member for *_, member in items]))
            for offset, words, dst, _ in items:
                dst[:words] = staging.view(-1)[offset:offset + words]
        return DecodeGroup(key, rng.randint(1, 4), launch)

    monkeypatch.setattr(streams.staging, "view", viewed)
    monkeypatch.setattr(streams.staging, "span", spanned)
    groups, loads = [layer_group("layer0"), layer_group("layer1")], []
    for value in range(1, 61):
        dst = torch.zeros(16, dtype=torch.int32)
        loads.append((dst, value, load(streams, dst, value, rng.choice(groups), member=value % 8)))
        if rng.random() < 0.2:
            streams.wait_all([rng.choice(loads)[2]])
        if rng.random() < 0.2:
            streams.start_copies()
    streams.synchronize()
    decode_record = {id(entry[2]): i for i, entry in enumerate(LOG) if entry[:2] == ("record", "decode")}
    for position, rows_written in copied:
        for row in rows_written:
            launched = [at for at, rows in read.items() if at < position and row in rows]
            if launched:  # the ready event recorded after that launch, or a later decode event, was waited for
                assert any(kind == "wait" and name == "copy" and decode_record.get(id(event), -1) > max(launched)
                           for kind, name, event in LOG[:position]), (row, position)
    assert all(dst[:5 + value % 8].eq(value).all() for dst, value, _ in loads) and len(read) > 10


def test_group_copies_launch_when_compute_needs_a_deferred_load(streams, rows):
    streams.group_copies = True
    ready = load(streams, rows[0], 9, grouped("layer0", size=8), member=0)
    assert copy_records() == []
    streams.wait_all([ready])
    assert len(copy_records()) == 2 and launches() == [("launch", "layer0", [0])] and rows[0, 0] == 9


def test_started_copies_cross_before_their_group_launches(streams, rows):
    """start_copies: the deferred copies go now; loads joining later cross at the launch, which waits for them."""
    streams.group_copies = True
    group = grouped("layer0", size=3)
    load(streams, rows[0], 5, group, member=0)
    load(streams, rows[1], 6, group, member=1)
    streams.start_copies()
    assert len(copy_records()) == 2 and launches() == [] and not rows.any()  # in staging, not decoded yet
    streams.start_copies()  # nothing left to start
    assert len(copy_records()) == 2
    load(streams, rows[2], 7, group, member=2)
    assert len(copy_records()) == 4 and launches() == [("launch", "layer0", [0, 1, 2])]
    last_arrival = copy_records()[-1][2]
    assert LOG.index(("wait", "decode", last_arrival)) < LOG.index(launches()[0])
    assert streams.stats()["h2d_copies"] == 3 and [int(rows[i, 0]) for i in range(3)] == [5, 6, 7]


def test_start_copies_does_nothing_without_group_copies(streams, rows):
    load(streams, rows[0], 5, grouped("layer0", size=3), member=0)  # copied at once, decode pending
    records = len(copy_records())
    streams.start_copies()
    assert len(copy_records()) == records == 2 and launches() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group_copies", [False, True])
def test_grouped_loads_through_two_staging_rows_each_land_intact_on_cuda(monkeypatch, group_copies):
    """Real streams, the decode stream held back by a long kernel: a blob's staging row is copied over only
    after the decode that read it, a decode reads only its own arrived blobs, a wave waits for its decodes,
    and the waits `StreamWaits` spares change none of that (every row ends with its own load's values)."""
    monkeypatch.setattr(streams_module, "STAGING_BYTES", 1)  # two staging rows, reused by every other load
    streams = DeviceStreams(torch.device("cuda"))
    streams.group_copies = group_copies
    rows = torch.zeros(24, 64, dtype=torch.int32, device="cuda")
    blobs = [torch.full((40 + i % 3,), i + 1, dtype=torch.int32).pin_memory() for i in range(24)]

    def launch(staging, items):
        torch.cuda._sleep(2_000_000)  # the decode stream runs late: copies would overrun a row still to be read
        for offset, words, dst, _ in items:
            dst[:words].copy_(staging.view(-1)[offset:offset + words])
    group = DecodeGroup("layer0", 3, launch)
    ready = [streams.copy_decoded(rows[i], blobs[i], None, 48, group=group, member=i) for i in range(24)]
    checks = []
    for i in range(0, 24, 2):  # waves of two: the compute stream reads what the decodes wrote
        streams.wait_all(ready[i:i + 2])
        checks.append(rows[i:i + 2, :40].clone())
    torch.cuda.synchronize()
    for i, check in zip(range(0, 24, 2), checks):
        assert check[0].eq(i + 1).all() and check[1].eq(i + 2).all(), f"loads {i}, {i + 1}"
    for i in range(24):
        assert rows[i, :40 + i % 3].eq(i + 1).all() and not rows[i, 40 + i % 3:].any()
    if not group_copies:  # grouped copies wait once per distinct reader already: nothing left to spare there
        assert streams.stats()["stream_waits_skipped"] > 0
