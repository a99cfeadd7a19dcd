"""benchmarks/row_log.py: a benchmark's CSV row by row, each row with its commit, host and workload."""
import csv
import os
import subprocess
import sys

import pytest

from tests.scripts import BENCHMARKS, load_script

row_log = load_script("row_log")


def read(path):
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_each_row_is_in_the_file_as_soon_as_it_is_added(tmp_path):
    log = row_log.RowLog(tmp_path / "out" / "offload.csv", commit_id="abc1234", host_name="h200-1 (NVIDIA H200)")
    assert (tmp_path / "out" / "offload.csv").read_text() == ""  # a run that measures nothing leaves no old rows
    log.add({"system": "specter_paper", "tpot_ms": 20.0}, "dsv2 mem=low")
    assert read(log.path) == [{"commit": "abc1234", "host": "h200-1 (NVIDIA H200)", "workload": "dsv2 mem=low",
                               "system": "specter_paper", "tpot_ms": "20.0"}]
    written = log.add({"system": "specter", "tpot_ms": 12.5, "commit": "ignored"}, "dsv2 mem=low")
    assert written["commit"] == "abc1234" and [r["system"] for r in read(log.path)] == ["specter_paper", "specter"]


def test_a_row_with_a_new_column_rewrites_the_header_and_keeps_every_row(tmp_path):
    log = row_log.RowLog(tmp_path / "kernel.csv", commit_id="c", host_name="h")
    log.add({"system": "a", "ms": 1}, "w1")
    log.add({"system": "b", "ms": 2, "tpot_over_paper": 0.6}, "w2")
    log.add({"system": "c"}, "w2")
    rows = read(log.path)
    assert list(rows[0]) == ["commit", "host", "workload", "system", "ms", "tpot_over_paper"]
    assert [(r["system"], r["ms"], r["tpot_over_paper"]) for r in rows] == [("a", "1", ""), ("b", "2", "0.6"),
                                                                         ("c", "", "")]


def test_the_commit_comes_from_the_environment_or_git(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECTER_COMMIT", "deadbee")
    assert row_log.commit() == "deadbee"
    monkeypatch.delenv("SPECTER_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=row_log.ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert row_log.commit().removesuffix("-dirty") == head.stdout.strip()
    monkeypatch.setattr(row_log, "ROOT", tmp_path)  # no repository there
    assert row_log.commit() == "unknown"
    assert row_log.host()


@pytest.mark.slow
def test_the_kernel_bench_writes_its_rows_with_their_provenance(tmp_path):
    """bench_kernel.py --smoke (the Triton interpreter on the CPU): kernel.csv as the figures read it, stamped."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_kernel.py"), "--smoke", "--tokens", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "SPECTER_COMMIT": "feed123"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read(tmp_path / "kernel.csv")
    assert {r["system"] for r in rows} >= {"fused_int4", "fp16_expert_wise"}
    assert all(r["commit"] == "feed123" and r["host"] and "smoke" in r["workload"] and float(r["median_ms"]) > 0
               for r in rows)

