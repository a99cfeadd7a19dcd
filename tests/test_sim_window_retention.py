"""benchmarks/sim_window_retention.py: what each retention policy keeps, and loads per window on a small trace."""

import pytest

from tests.scripts import load_script

sim = load_script("sim_window_retention")

WINDOW = [[0, 1], [0, 2], [0, 3]]  # expert 0 three times, 1-3 once each; 3 used last
NEXT = [[1, 4], [1, 5], [4, 5]]


@pytest.mark.parametrize("policy, kept", [
    ("last_loaded", {2, 3}),  # verify order: 0 first (most frequent), then 1, 2, 3
    ("most_frequent", {0, 1}),  # 0, then the lowest id among the ties
    ("most_recent_use", {0, 3}),  # both used at the last position
    ("oracle_next", {1, 0}),  # 1 is used next; 0 fills the other slot
])
def test_kept_after(policy, kept):
    assert sim.kept_after(policy, WINDOW, set(), 2, NEXT) == kept


def test_free_slots_keep_their_experts_and_loads_count_misses():
    assert sim.kept_after("most_frequent", [[0, 1]], {7, 8, 9}, 4, []) == {0, 1, 7, 8}
    trace = WINDOW + NEXT + WINDOW  # windows of 3 tokens; with 64 slots: 4 loads, 2 (4 and 5), none
    assert sim.loads_per_window(trace, 2, 3, "oracle_next") < sim.loads_per_window(trace, 2, 3, "last_loaded")
    assert sim.loads_per_window(trace, 64, 3, "last_loaded") == pytest.approx((4 + 2 + 0) / 3)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        sim.kept_after("fifo", WINDOW, set(), 2, NEXT)
