"""scripts/sim_draft_gate.py: where the gate ends a window, and loads and commits over a hand-made walk."""

from tests.scripts import load_script

sim = load_script("sim_draft_gate")


def walk(probs, agrees, routing):
    """A Walk of one MoE layer: routing [T][k], draft probability and agreement per committed position."""
    return sim.Walk([routing], probs, agrees)


def test_the_gate_stops_at_the_first_unsure_draft_after_min_draft():
    w = walk([1.0, 0.9, 0.2, 0.9, 0.1, 0.9], [True] * 6, [[0]] * 6)
    assert sim.window_length(w, 0, 8, 0.0, 1) == 5  # ungated: to the walk's end
    assert sim.window_length(w, 0, 3, 0.0, 1) == 3  # at most K
    assert sim.window_length(w, 0, 8, 0.5, 1) == 1  # position 2 is unsure
    assert sim.window_length(w, 1, 8, 0.5, 1) == 2  # the first draft is always kept (min_draft 1)
    assert sim.window_length(w, 0, 8, 0.5, 3) == 3


def test_replay_commits_every_token_once_and_counts_each_windows_new_experts():
    routing = [[0], [1], [2], [3], [4], [5]]  # every position its own expert
    agrees = [True, True, False, True, True, True]  # the draft of position 2 is rejected
    ungated = sim.replay(walk([1.0] * 6, agrees, routing), 8, 1, 0.0, 1)
    # window 1: positions 0..5 verified (5 drafts), 1 accepted, commits 2 (to position 2); window 2: 2..5
    assert ungated["committed"] == 5 and ungated["windows"] == 2
    assert ungated["drafted"] == 5 + 3 and ungated["accepted"] == 1 + 3
    assert ungated["loads"] == 6 + 3  # 0-5, then 2, 3 and 4 again (only 5 was kept)
    gated = sim.replay(walk([1.0, 1.0, 0.1, 1.0, 1.0, 1.0], agrees, routing), 8, 1, 0.5, 1)
    # window 1 stops before position 2: verifies 0, 1, commits 1 and the bonus; then 2..5
    assert gated["committed"] == 5 and gated["windows"] == 2 and gated["loads"] == 2 + 4
    assert sim.summary([gated])["loads_per_token_layer"] == 6 / 5
