"""One definition of bytes per token and one bandwidth per run: the main job's bytes and I/O floor columns."""
import json

import pandas as pd
import pytest

import specter.offload.pinned as pinned
from experiments.main import run
from specter.offload.pinned import LinkMeasurement
from tests.cli import compose_with

PEERS = "systems=[specter,specter_paper,target_only,mo_sm,specmoeoff_sm]"
FAST = ("num_prompts=1", "repeats=1", "max_new_tokens=6", "device=cpu", "dataset=builtin")


def run_tiny(tmp_path, monkeypatch, systems: str = PEERS):
    monkeypatch.chdir(tmp_path)
    out = run(compose_with(systems, *FAST, f"results_root={tmp_path}"))
    return pd.read_csv(out / "records.csv"), json.loads((out / "run.json").read_text()), out


@pytest.mark.slow
def test_every_system_that_moves_experts_has_bytes_and_no_floor_without_a_gpu(tmp_path, monkeypatch, capsys):
    records, info, _ = run_tiny(tmp_path, monkeypatch)
    moving = records[records.system != "target_only"].set_index("system")
    assert (moving.decode_h2d_bytes_per_token > 0).all() and (moving.prefill_h2d_bytes > 0).all()
    assert records.io_floor_ms.isna().all()  # no PCIe on a CPU: the floor columns stay empty
    assert info["h2d_gbps"] is None and info["h2d"] is None
    out = capsys.readouterr().out
    assert "MB/token" in out and "x floor" not in out and "I/O floor" not in out


def fake_link(rates: tuple[float, ...], seen: list | None = None):
    """A stand-in for pinned.measure_link: the trials' rates it reports, the sources it was given in `seen`."""
    def measure(device, sources=(), source="fake"):
        if seen is not None:
            seen.append(list(sources))
        return LinkMeasurement(rates, 2**30, "fake")
    return measure


@pytest.mark.slow
def test_the_link_measured_after_the_warm_ups_gives_every_row_its_floor_and_specter_the_lowest_peer_floor(
        tmp_path, monkeypatch, capsys):
    seen = []
    # faster than any CPU copy: a system moving data faster than the link would get a warning instead of its claim
    monkeypatch.setattr(pinned, "measure_link", fake_link((200.0, 250.0, 240.0), seen))
    records, info, out_dir = run_tiny(tmp_path, monkeypatch, "systems=[specter,mo_sm,specmoeoff_sm]")
    assert len(seen) == 1 and seen[0] and all(t.device.type == "cpu" for t in seen[0])  # the host store's layers
    assert info["h2d_gbps"] == 250.0 and info["h2d"]["trials_gbps"] == [200.0, 250.0, 240.0]  # max for floors
    assert info["h2d"]["median_gbps"] == 240.0 and info["h2d"]["min_gbps"] == 200.0
    assert records.io_floor_ms.tolist() == pytest.approx((records.decode_h2d_bytes_per_token / 250e6).tolist())
    assert (records.link_gbps == 250.0).all()
    summary = pd.read_csv(out_dir / "summary.csv").set_index(["system", "dataset"])
    peers = summary.loc[[("mo_sm", "builtin"), ("specmoeoff_sm", "builtin")]]
    lowest = peers.io_floor_ms.idxmin()[0]
    specter = summary.loc[("specter", "builtin")]
    assert specter.lowest_peer_floor == lowest
    assert specter.tpot_over_peer_floor == pytest.approx(specter.tpot_median_ms / peers.io_floor_ms.min())
    assert specter.tpot_over_io_floor == pytest.approx(specter.tpot_median_ms / specter.io_floor_ms)
    out = capsys.readouterr().out
    claim = f"specter / builtin: TPOT {specter.tpot_over_peer_floor:.2f}x {lowest}'s I/O floor"
    assert "x floor" in out and claim in out
    assert "H2D 250.0 GB/s pinned (max of 3 trials of 1.0 GiB; median 240.0, min 200.0)" in out
    monkeypatch.setattr(pinned, "measure_link", fake_link((99.0,)))  # a resumed process measures its own link
    resumed = run(compose_with("systems=[specter,mo_sm,specmoeoff_sm]", *FAST, f"results_root={tmp_path}",
                               f"results_dir={out_dir}", "resume=force", "repeats=2"))
    info = json.loads((resumed / "run.json").read_text())
    assert [c["h2d"]["max_gbps"] for c in info["invocations"]] == [250.0, 99.0] and info["h2d_gbps"] == 99.0
    rows = pd.read_csv(resumed / "records.csv")
    assert sorted(set(rows.invocation)) == [0, 1]
    assert rows.groupby("invocation").link_gbps.unique().map(list).tolist() == [[250.0], [99.0]]


@pytest.mark.slow
def test_a_link_slower_than_what_a_system_moved_is_reported_and_no_floor_claim_is_printed(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(pinned, "measure_link", fake_link((1e-9,)))  # far below any decode's bytes per TPOT
    run_tiny(tmp_path, monkeypatch, "systems=[specter,mo_sm]")
    out = capsys.readouterr().out
    assert "faster than the measured link rate: that measurement is too low" in out
    assert "I/O floor, the lowest" not in out and "no implementation" not in out
