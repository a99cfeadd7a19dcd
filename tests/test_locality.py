"""Hit-rate curves of routing traces: the moe-lrc semantics, hand-checked on small traces."""
from __future__ import annotations

import pytest

from experiments.locality import (
    belady_victim_for,
    calibration_error,
    hit_rate,
    lfu_victim_for,
    locality_curves,
    lookahead_victim_for,
    lru_victim,
    reference_curves,
)


def test_lru_looks_up_a_token_before_inserting_it():
    # capacity 2: token 1 hits expert 1 (left by token 0); token 2 hits 2 and 3 is a miss.
    trace = [[0, 1], [1, 2], [2, 3]]
    assert hit_rate(trace, 2, lru_victim) == pytest.approx((2 + 1 + 1) / 6)  # first two uses fill the cache


def test_first_uses_hit_while_the_cache_is_not_full():
    assert hit_rate([[0, 1], [2, 3]], 4, lru_victim) == 1.0
    assert hit_rate([[0, 1], [2, 3]], 2, lru_victim) == 0.5


def test_lru_capacity_below_top_k_keeps_the_lowest_ranked():
    # capacity 1 keeps the last inserted (rank 2) expert of the previous token.
    assert hit_rate([[0, 1], [1, 5], [0, 7]], 1, lru_victim) == pytest.approx((1 + 1 + 0) / 6)


def test_belady_keeps_what_is_needed_soonest_and_may_drop_the_expert_just_used():
    trace = [[0], [1], [0], [1], [0]]
    assert hit_rate(trace, 1, lru_victim) == pytest.approx(1 / 5)  # only the first use (cache filling)
    # Belady with one slot keeps 0 (needed at 2 and 4) and bypasses 1.
    assert hit_rate(trace, 1, belady_victim_for(trace)) == pytest.approx(3 / 5)


def test_lfu_and_lookahead_keep_the_frequent_expert():
    trace = [[0], [0], [0], [1], [2], [0]]  # at token 4 expert 2 evicts the least recent (0) or the rarer (1)
    assert hit_rate(trace, 2, lru_victim) == pytest.approx(4 / 6)
    assert hit_rate(trace, 2, lfu_victim_for(trace)) == pytest.approx(5 / 6)
    assert hit_rate(trace, 2, lookahead_victim_for(trace)) == pytest.approx(5 / 6)


def test_curves_weight_traces_by_length_and_cover_every_policy():
    curves = locality_curves([[[0, 1]] * 4, [[0, 1], [2, 3]]], 2, rhos=(1.0, 2.0))
    assert set(curves) == {(p, r) for p in ("LRU", "LFU", "Belady", "SCH16") for r in (1.0, 2.0)}
    assert curves[("LRU", 1.0)] == pytest.approx((4 * 1.0 + 2 * 0.5) / 6)


def test_reference_table_has_the_four_models_rows():
    dsv2 = reference_curves("DeepSeek-V2-Lite")
    assert dsv2[("LRU", 1.0)] == 0.28 and dsv2[("Belady", 2.0)] == 0.65
    assert reference_curves("Phi-3.5-MoE")[("LRU", 3.0)] == 0.77  # '~' values are read too
    assert reference_curves("Mixtral-8x7B-v0.1")[("LRU", 4.0)] == 1.0
    assert reference_curves("Qwen1.5-MoE-A2.7B")[("SCH16", 4.0)] == 0.68


def test_calibration_error_is_largest_and_mean_difference():
    assert calibration_error({"a": 0.1, "b": 0.5}, {"a": 0.2, "b": 0.5}) == pytest.approx((0.1, 0.05))
