"""One definition of bytes per token and one bandwidth per run: the main job's bytes and I/O floor columns."""
import json

import pandas as pd
import pytest

import experiments.machine as machine
from experiments.main import run
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
    assert info["h2d_gbps"] is None and info["machine"]["h2d_gbps"] is None
    out = capsys.readouterr().out
    assert "MB/token" in out and "x floor" not in out and "I/O floor" not in out


@pytest.mark.slow
def test_one_bandwidth_gives_every_row_its_floor_and_specter_the_lowest_peer_floor(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(machine, "pinned_h2d_gbps", lambda device: calls.append(device) or 25.0)
    records, info, out_dir = run_tiny(tmp_path, monkeypatch, "systems=[specter,mo_sm,specmoeoff_sm]")
    assert len(calls) == 1 and info["h2d_gbps"] == 25.0  # measured once, in run.json
    assert records.io_floor_ms.tolist() == pytest.approx((records.decode_h2d_bytes_per_token / 25e6).tolist())
    summary = pd.read_csv(out_dir / "summary.csv").set_index(["system", "dataset"])
    peers = summary.loc[[("mo_sm", "builtin"), ("specmoeoff_sm", "builtin")]]
    lowest = peers.io_floor_ms.idxmin()[0]
    specter = summary.loc[("specter", "builtin")]
    assert specter.lowest_peer_floor == lowest
    assert specter.tpot_over_peer_floor == pytest.approx(specter.tpot_median_ms / peers.io_floor_ms.min())
    assert specter.tpot_over_io_floor == pytest.approx(specter.tpot_median_ms / specter.io_floor_ms)
    out = capsys.readouterr().out
    assert "x floor" in out and f"specter / builtin: TPOT {specter.tpot_over_peer_floor:.2f}x {lowest}'s I/O floor" in out
    monkeypatch.setattr(machine, "pinned_h2d_gbps", lambda device: 99.0)  # a resumed run keeps its bandwidth
    resumed = run(compose_with("systems=[specter,mo_sm,specmoeoff_sm]", *FAST, f"results_root={tmp_path}", f"results_dir={out_dir}", "resume=force",
                               "repeats=2"))
    info = json.loads((resumed / "run.json").read_text())
    assert info["h2d_gbps"] == 25.0 and [c["machine"]["h2d_gbps"] for c in info["invocations"]] == [25.0, 99.0]
    rows = pd.read_csv(resumed / "records.csv")
    assert sorted(set(rows.invocation)) == [0, 1]
