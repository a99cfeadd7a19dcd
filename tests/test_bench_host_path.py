"""benchmarks/bench_host_path.py: the verify pass's host path on CPU with CUDA faked."""
import pytest

from specter.offload.stream_waits import StreamWaits
from tests.scripts import load_script

bench = load_script("bench_host_path")


@pytest.fixture(scope="module")
def work():
    return bench.windows(bench.HostPathOptions(), 2)


def test_each_variant_verifies_the_same_windows_with_every_wait_on_a_recorded_event(work):
    """The fakes fail on a wait for an event never recorded; the loads depend on the windows alone."""
    rows = [bench.measure(bench.HostPathOptions(**fields), work, repeats=1)
            for fields in ({}, {"wave": 0}, {"group": 1}, {"group_copies": False})]
    assert len({round(row["loads_per_layer"], 6) for row in rows}) == 1 and rows[0]["loads_per_layer"] > 30
    assert rows[1]["waves_per_layer"] > rows[0]["waves_per_layer"]  # waves of half the slots: more waves
    assert rows[2]["decode_launches_per_layer"] == rows[2]["loads_per_layer"]  # groups of 1: a launch per load
    assert rows[3]["copies_per_layer"] == rows[3]["loads_per_layer"] > rows[0]["copies_per_layer"]  # one by one
    assert all(row["cuda_calls_per_layer"] > 0 and row["us_per_layer"] > 0 for row in rows)


def test_the_stream_waits_spare_calls_without_changing_the_work(work, monkeypatch):
    with_memo = bench.measure(bench.HostPathOptions(), work, repeats=1)
    monkeypatch.setattr(StreamWaits, "wait", lambda self, stream, event: event is None or stream.wait_event(event))
    monkeypatch.setattr(StreamWaits, "is_past", lambda self, stream, event: False)
    without = bench.measure(bench.HostPathOptions(), work, repeats=1)
    assert with_memo["loads_per_layer"] == without["loads_per_layer"]
    assert with_memo["waves_per_layer"] == without["waves_per_layer"]
    assert with_memo["waits_per_layer"] < 0.7 * without["waits_per_layer"]
    assert with_memo["queries_per_layer"] <= without["queries_per_layer"]


def test_the_command_prints_a_row_per_variant_and_rejects_unknown_options(capsys):
    assert bench.main(["--windows", "1", "--repeats", "1", "--variants", "pooled=0,group_copies=false"]) == 0
    out = capsys.readouterr().out
    assert "defaults: " in out and "pooled=0,group_copies=false: " in out and "x the defaults' host us" in out
    assert bench.main(["--windows", "1", "--variants", "waves=2"]) == 2
    assert "unknown or empty option 'waves=2'" in capsys.readouterr().err
    assert bench.parse_variant("group_copies=yes,slots=8") == {"group_copies": True, "slots": 8}


def test_pooled_slots_verify_in_far_fewer_waves_than_a_layers_own_slots(work):
    """The defaults (2 slots of each layer pooled, waves of every slot) against no pooled slots (the runtime's
    waves of half the slots), in the same rows."""
    assert bench.HostPathOptions().verify_wave == -1 and bench.HostPathOptions(pooled=0).verify_wave == 0
    pooled, plain = (bench.measure(bench.HostPathOptions(**fields), work, repeats=1) for fields in ({}, {"pooled": 0}))
    assert pooled["waves_per_layer"] < 0.25 * plain["waves_per_layer"]
    assert pooled["decode_launches_per_layer"] < plain["decode_launches_per_layer"]


def test_a_decode_group_never_outgrows_the_staging_rows(work):
    """The staging ring caps a group: with 4 staging rows, groups of 8 launch as often as groups of 4."""
    rows = [bench.measure(bench.HostPathOptions(group=group, staging_rows=staging, wave=-1, pooled=2), work, repeats=1)
            for group, staging in ((8, 4), (4, 4), (8, 16))]
    assert rows[0]["decode_launches_per_layer"] == rows[1]["decode_launches_per_layer"]
    assert rows[2]["decode_launches_per_layer"] < rows[0]["decode_launches_per_layer"]


def test_a_pooled_layer_loads_in_expert_order_so_grouped_copies_of_neighbours_cross_as_one(work):
    """With every planned load in flight at once (pooled slots, a wave of every slot) the loads go in expert
    order; grouped copies then merge neighbouring experts' blobs (adjacent in the layer's host buffer)."""
    grouped, apart = (bench.measure(bench.HostPathOptions(pooled=2, wave=-1, group_copies=copies), work, repeats=1)
                      for copies in (True, False))
    assert grouped["loads_per_layer"] == apart["loads_per_layer"]
    assert grouped["copies_per_layer"] < 0.7 * grouped["loads_per_layer"]
    assert apart["copies_per_layer"] == apart["loads_per_layer"]  # copies issued one by one never merge


def test_coded_slots_hold_more_experts_and_rebuild_each_wave_with_every_wait_on_a_recorded_event(work):
    """The same memory as blob rows (768-byte experts, 192-byte rows: 4x as many): fewer loads, a decode launch per
    wave (the rebuild) and none per load, waves of at most the scratch rows; the fakes fail on a wait for an event
    never recorded."""
    plain, coded = (bench.measure(bench.HostPathOptions(coded=flag), work, repeats=1) for flag in (False, True))
    assert coded["loads_per_layer"] < plain["loads_per_layer"]
    assert coded["decode_launches_per_layer"] == coded["waves_per_layer"] > plain["waves_per_layer"]
    assert coded["copies_per_layer"] == coded["loads_per_layer"]  # blob rows are apart: a copy per load
