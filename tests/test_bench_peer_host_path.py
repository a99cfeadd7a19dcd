"""benchmarks/bench_peer_host_path.py: the peers' host work per token on CPU with CUDA faked."""
import csv

import pytest
import torch

from specter.kernels.reference import expert_wise_moe
from tests.scripts import load_script

bench = load_script("bench_peer_host_path")

# Loads on the bench's 18 positions as the peers made them before their host paths were trimmed: a change of the
# host path may not move one byte more or less.
LOADS = {("mo_sc", 4): 2528, ("mo_sm", 20): 1562, ("specmoeoff_sc", 4): 2767, ("specmoeoff_sm", 1): 2840}


@pytest.fixture(scope="module")
def work():
    return bench.routing(bench.Stack(), 18)


@pytest.fixture(scope="module")
def rows(work):
    return {key: bench.measure(*key, bench.Stack(), work, repeats=1) for key in LOADS}


def test_the_peers_load_what_they_loaded_and_compute_the_same_outputs(rows):
    for (system, slots), loads in LOADS.items():
        row = rows[system, slots]
        tokens = row["tokens"]
        assert round(row["loads_per_token"] * tokens) == round(row["copies_per_token"] * tokens) == loads, system
        assert row["h2d_bytes_per_token"] * tokens == loads * 3 * 8 * 16 * 4  # one fp32 expert [3*I*H] a load
    assert len({round(row["checksum"], 6) for row in rows.values()}) == 1  # token-wise verify = MO's decode steps


def test_mo_copies_on_the_compute_stream_with_no_event_to_wait_for(rows):
    """The original's one stream: a load is its copy and its two timing records; no waits, queries or stream
    switches; per layer one host read and the experts' kernels (4 each), one stack and the combine (2)."""
    for slots in (4, 20):
        row = rows["mo_sc" if slots == 4 else "mo_sm", slots]
        assert row["records_per_token"] == 2 * row["copies_per_token"] > 0
        assert row["waits_per_token"] == row["queries_per_token"] == row["stream_switches_per_token"] == 0
        layers, top_k = bench.Stack().layers, bench.Stack().top_k
        assert row["host_reads_per_token"] == layers
        assert row["launches_per_token"] == layers * (4 * top_k + 3)


def test_specmoeoff_rows_split_the_window_by_phase(rows):
    row = rows["specmoeoff_sm", 1]
    phases = ("k_and_accounting", "prefetch", "verify")
    assert all(row[f"{phase}_us_per_token"] > 0 for phase in phases)
    assert sum(row[f"{phase}_us_per_token"] for phase in phases) == pytest.approx(row["us_per_token"], rel=0.05)
    assert row["tokens"] == 2 * (bench.Stack().accepted + 1)  # 18 positions: two windows of K + 1


def test_a_decode_step_through_mo_equals_the_expert_wise_reference(work):
    """The decode step's path (one host read, outputs stacked in slot order) against group_by_expert's."""
    stack, fake = bench.Stack(), bench.FakeCuda()
    with fake.installed(), torch.inference_mode():
        peer = bench.MOPeer(stack, 4, fake, bench.host_store(stack))
        store, hidden = peer.cache.store, torch.randn(1, stack.hidden)
        weights = torch.softmax(torch.randn(1, stack.top_k), dim=-1)
        for token in work[:3]:
            for module, top_k_index in zip(peer.modules, token):
                gate_up, down = store.layer_weights(module.moe_layer)
                want = expert_wise_moe(hidden, top_k_index, weights, lambda e: (gate_up[e], down[e]),
                                       stack.experts, module.act_fn)
                torch.testing.assert_close(peer.executor(module, hidden, top_k_index, weights), want)


def test_the_command_writes_a_row_per_system_and_profiles(tmp_path, capsys):
    out = tmp_path / "peers.csv"
    assert bench.main(["--tokens", "9", "--repeats", "1", "--mems", "low", "--out", str(out), "--profile", "3"]) == 0
    table = list(csv.DictReader(out.open()))
    assert [r["system"] for r in table] == list(bench.SYSTEMS) and {r["mem"] for r in table} == {"low"}
    assert all(r["commit"] and r["host"] and r["workload"] and float(r["us_per_token"]) > 0 for r in table)
    text = capsys.readouterr().out
    assert "own time per function" in text and "mo_sm dsv2-low (20 slots): " in text
    assert bench.main(["--tokens", "3"]) == 2
