"""Copy/compute overlap accounting of a profiler trace (hand-made events, times in microseconds)."""
import json

import pytest

from specter.device.trace_overlap import (
    complement,
    copy_gaps_by_cause,
    copy_idle_by_phase,
    intersect,
    merge,
    overlap_report,
    read_trace,
)

MB = 1 << 20


def copy(ts, dur, nbytes=17 * MB):
    return {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"bytes": nbytes}}


def kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_interval_algebra():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert complement([(1, 2), (4, 5)], 0, 6) == [(0, 1), (2, 4), (5, 6)]


def test_overlap_report_splits_the_span(tmp_path):
    events = [copy(0, 4000), copy(6000, 2000), copy(6500, 10, nbytes=64),  # the tiny copy is no expert
              kernel("attention", 3000, 2000), kernel("slot_moe", 5000, 1000), kernel("slot_moe", 9000, 1000),
              {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 100, "dur": 700}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = overlap_report(read_trace(path))
    assert report["span_ms"] == pytest.approx(10.0)
    assert report["copy_busy_ms"] == pytest.approx(6.0) and report["compute_busy_ms"] == pytest.approx(4.0)
    assert report["both_busy_ms"] == pytest.approx(1.0)  # attention over the first copy's last ms
    assert report["copy_idle_compute_busy_ms"] == pytest.approx(3.0)
    assert report["idle_ms"] == pytest.approx(1.0)  # 8-9 ms: nothing ran
    assert report["expert_copies"] == 2 and report["host_wait_ms"] == pytest.approx(0.7)
    assert report["kernels_while_copy_idle"] == [("slot_moe", 2.0), ("attention", 1.0)]


def test_copy_idle_by_phase():
    copies = [(1, 3), (2, 4), (9, 12)]  # busy 1-4 and 9-12
    phases = {"draft": [(0, 5), (10, 11)], "verify": [(6, 10), (11, 14)]}
    stats = copy_idle_by_phase(copies, phases)
    assert stats["copy_idle_draft_ms"] == pytest.approx(2.0)  # 0-1 and 4-5
    assert stats["copy_idle_verify_ms"] == pytest.approx(5.0)  # 6-9 and 12-14
    assert stats["copy_idle_between_ms"] == pytest.approx(1.0)  # 5-6


def test_copy_gaps_split_into_slot_waits_and_late_issue():
    # gaps: 0-1 (first copy had no slot to wait for), 4-9 (next copy's slot freed at 7), 12-14 (nothing left)
    copies = [(1, 3, None), (2, 4, 1.5), (9, 12, 7.0)]
    stats = copy_gaps_by_cause(copies, 0, 14)
    assert stats["copy_gap_slot_ms"] == pytest.approx(3.0)  # 4-7
    assert stats["copy_gap_host_ms"] == pytest.approx(1.0 + 2.0 + 2.0)  # 0-1, 7-9, 12-14
    late = copy_gaps_by_cause([(1, 2, None), (5, 6, 9.0)], 0, 6)  # a slot freed after its copy started:
    assert late["copy_gap_slot_ms"] == pytest.approx(3.0)  # (an event on another clock) caps at the gap


def test_copies_with_equal_spans_are_ordered_without_comparing_their_slot_free_times():
    stats = copy_gaps_by_cause([(1, 2, None), (1, 2, 0.5), (4, 5, 3.0)], 0, 6)  # None against 0.5: no TypeError
    assert stats == {"copy_gap_slot_ms": pytest.approx(1.0), "copy_gap_host_ms": pytest.approx(3.0)}


def test_copy_idle_by_phase_with_slot_free_times_splits_gaps():
    stats = copy_idle_by_phase([(1, 3, None), (6, 8, 5.0)], {"draft": [(0, 4)], "verify": [(4, 9)]})
    assert stats["copy_gap_slot_ms"] == pytest.approx(2.0)  # 3-5
    assert stats["copy_gap_host_ms"] == pytest.approx(3.0)  # 0-1, 5-6, 8-9


def test_an_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="no GPU kernels"):
        overlap_report([{"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1}])
