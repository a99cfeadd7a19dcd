"""Staging rows (`specter.offload.staging`): packed placement, rows reached, and copies merged where blobs lie end
to end in both memories."""
import torch

from specter.offload.staging import StagingRows


def staging(count: int = 3, width: int = 10) -> StagingRows:
    rows = StagingRows(torch.device("cpu"))
    rows.allocate(count, width, torch.int32)
    return rows


def test_packed_blobs_lie_end_to_end_and_name_only_the_rows_they_reach_first():
    rows = staging()
    assert rows.pack(4) == (0, range(1), range(1))
    assert rows.pack(4) == (4, range(1), range(1, 1))  # still row 0: nothing new
    assert rows.pack(5) == (8, range(2), range(1, 2))  # on into row 1
    assert rows.offset(2) == 20
    rows.close()
    assert rows.pack(3) == (20, range(2, 3), range(2, 3))  # a row of its own after a close
    assert rows.pack(9) == (0, range(1), range(1))  # would pass the end: the next row in turn, row 0
    assert rows.take() == 1 and rows.pack(2)[0] == 20  # take closes packing too


def test_copies_merge_only_where_both_sides_continue_in_one_storage():
    rows = staging()
    host, other = torch.arange(30, dtype=torch.int32), torch.arange(100, 130, dtype=torch.int32)
    copies = [(0, host[0:4]), (4, host[4:9]),  # both continue: one copy
              (9, host[10:13]),  # the host side skips a word
              (12, other[13:16]),  # another storage
              (15, other[16:21]),  # continues the previous one
              (21, other[21:23])]  # the staging side skips a word
    rows.flat.zero_()
    pairs = rows.copy_pairs(copies)
    assert [(dst.numel(), src.numel()) for dst, src in pairs] == [(9, 9), (3, 3), (8, 8), (2, 2)]
    for dst, src in pairs:
        dst.copy_(src)
    want = torch.zeros(30, dtype=torch.int32)
    for offset, blob in copies:
        want[offset:offset + blob.numel()] = blob
    assert torch.equal(rows.flat, want)
