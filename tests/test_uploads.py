"""Upload rings: small host tables reach the device intact, on CPU (host tensors) and through pinned rings on CUDA."""
import pytest
import torch

from specter.offload.streams import DeviceStreams
from specter.offload.uploads import MIN_CAPACITY, RING_BUFFERS, slab_capacity


def test_upload_rows_gives_the_rows_as_an_int64_table_on_cpu():
    streams = DeviceStreams(torch.device("cpu"))
    table = streams.upload_rows([(0, 7, 3, 96), (5, 2, 1, -4)], 4)
    assert table.dtype == torch.long and table.tolist() == [[0, 7, 3, 96], [5, 2, 1, -4]]
    assert streams.upload_rows([(1, 2, 3, 4)], 4).shape == (1, 4)


def test_a_ring_slab_grows_by_doubling_only_when_a_table_does_not_fit():
    assert slab_capacity(0) == slab_capacity(4) == MIN_CAPACITY
    assert slab_capacity(MIN_CAPACITY + 1) == 2 * MIN_CAPACITY
    assert slab_capacity(1000) == 1024 and slab_capacity(1024) == 1024
    assert slab_capacity(100, current=128) == 128  # fits: kept
    assert slab_capacity(129, current=128) == 256  # doubled
    assert slab_capacity(1100, current=128) == 2048  # the power of two that holds it
    sizes, current = [], 0
    for numel in range(1, 5000):
        current = slab_capacity(numel, current)
        sizes.append(current)
    assert len(set(sizes)) == 8  # 64 .. 8192: a slab per doubling, not one per table length


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uploads_through_a_ring_reused_many_times_each_arrive_intact_on_cuda():
    """More uploads than a ring holds, the GPU kept busy meanwhile: a buffer comes round again only once its
    last copy has run, so every table and map on the device holds what was uploaded."""
    streams = DeviceStreams(torch.device("cuda"))
    busy = torch.randn(2048, 2048, device="cuda")
    tables, maps = [], []
    for i in range(3 * RING_BUFFERS):
        if i % 16 == 0:
            busy = busy @ busy / 2048  # queue work ahead of the copies
        rows = [(i, i + 1, i % 5, 10 * i + j) for j in range(1 + i % 3)]
        tables.append((rows, streams.upload_rows(rows, 4, ring="decode")))
        entries = [(i % 7, i), ((i + 3) % 7, -i)]
        maps.append((entries, streams.upload_map(7, entries)))
    torch.cuda.synchronize()
    for rows, table in tables:
        assert table.is_cuda and table.tolist() == [list(row) for row in rows]
    for entries, row_map in maps:
        expected = [-1] * 7
        for index, value in entries:
            expected[index] = value
        assert row_map.tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tables_of_many_shapes_share_a_few_pinned_slabs_per_ring():
    """Decode-group tables of 1..40 rows, each length many times over: a ring's buffers are one slab that grows by
    doubling, so the pinned allocator creates a few blocks per ring, not one per buffer and length."""
    streams = DeviceStreams(torch.device("cuda"))
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    tables = []
    for repeat in range(3):
        for length in range(1, 41):
            rows = [(repeat, length, j, -j) for j in range(length)]
            tables.append((rows, streams.upload_rows(rows, 4, ring="decode")))
    torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) - before <= 4
    for rows, table in tables:
        assert table.tolist() == [list(row) for row in rows]
