"""Metric definitions: TPOT, acceptance counting; garbage collection paused around timed decodes."""
import csv
import gc
import math

import pytest

from specter.metrics import acceptance_stats, gc_paused, tpot_ms, write_rows_csv


def test_tpot_is_span_over_n_minus_one():
    assert tpot_ms([10.0, 12.0, 12.0, 19.0]) == 3.0
    assert math.isnan(tpot_ms([5.0]))


def test_rejected_window_counts_the_rejected_position_as_checked():
    stats = acceptance_stats([(4, 4), (4, 1), (4, 0), (0, 0)])  # full, rejected at 2, rejected at 1, last step
    assert stats["accepted_tokens"] == 5
    assert stats["acceptance_rate"] == 5 / (4 + 2 + 1)
    assert stats["mean_accepted_length"] == 5 / 3
    assert stats["accepted_length_histogram"] == {0: 1, 1: 1, 4: 1}
    assert stats["draft_tokens"] == 12


def test_no_windows():
    assert math.isnan(acceptance_stats([])["acceptance_rate"])


@pytest.mark.parametrize("enabled_before", [True, False])
def test_gc_paused_pauses_collection_and_restores_the_previous_state(enabled_before):
    (gc.enable if enabled_before else gc.disable)()
    try:
        with pytest.raises(RuntimeError):
            with gc_paused():
                assert not gc.isenabled()
                raise RuntimeError("a failing decode")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


def test_decode_bytes_per_token_and_the_io_floor_at_one_bandwidth():
    from specter.metrics import h2d_split, io_floor_ms

    stats = h2d_split({"h2d_bytes": 5e7}, prefill_bytes=1e7, decode_tokens=10)
    assert (stats["prefill_h2d_bytes"], stats["decode_h2d_bytes"], stats["decode_h2d_bytes_per_token"]) == (1e7, 4e7, 4e6)
    assert h2d_split({"tpot_ms": 1.0}, 0, 10) == {"tpot_ms": 1.0}  # a system that moves nothing has no bytes
    assert io_floor_ms(4e6, 50.0) == pytest.approx(0.08)  # 4 MB at 50 GB/s
    assert math.isnan(io_floor_ms(4e6, None)) and math.isnan(io_floor_ms(float("nan"), 50.0))  # no PCIe, no bytes


def test_rows_csv_has_a_column_for_a_key_the_first_row_lacks(tmp_path):
    rows = [{"system": "target_only", "tpot_ms": 80.0},
            {"system": "specter", "tpot_ms": 20.0, "tpot_over_specter": None},
            {"system": "options", "tpot_ms": 11.0, "tpot_over_specter": 0.55}]
    path = write_rows_csv(tmp_path / "out" / "rows.csv", rows)
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == ["system", "tpot_ms", "tpot_over_specter"]
    assert [r["tpot_over_specter"] for r in read] == ["", "", "0.55"]
