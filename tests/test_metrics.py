"""Metric definitions: TPOT, acceptance counting; garbage collection paused around timed decodes."""
import gc
import math

import pytest

from specter.metrics import acceptance_stats, gc_paused, tpot_ms


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
