"""The link's bandwidth measurement: trials of >= 1 GiB from the run's own host memory, warm-ups dropped, every trial
kept; the maximum is the floor's rate (timed here with a fake clock)."""
import pytest
import torch

from specter.offload.pinned import LinkMeasurement, measure_link, time_trials, trial_chunks


def test_a_trial_takes_chunks_of_the_sources_in_order_and_goes_round_again_until_it_has_enough_bytes():
    a, b = torch.arange(10, dtype=torch.uint8), torch.arange(3, dtype=torch.int16)  # 10 and 6 bytes
    chunks = trial_chunks([a, b], trial_bytes=30, chunk_bytes=4)
    assert [c.numel() for c in chunks] == [4, 4, 2, 4, 2, 4, 4, 2, 4]  # a in 4/4/2, b in 4/2, then a again
    assert sum(c.numel() for c in chunks) >= 30
    assert chunks[0].data_ptr() == a.data_ptr() and chunks[3].data_ptr() == b.data_ptr()  # views, no copies
    with pytest.raises(ValueError, match="no host memory"):
        trial_chunks([torch.empty(0)], trial_bytes=8)


def test_warm_ups_are_run_untimed_and_every_trial_is_kept():
    clock = iter([500.0, 40.0, 20.0, 25.0])
    assert time_trials(lambda: next(clock), trials=3, warmups=1) == [40.0, 20.0, 25.0]


def test_the_measurement_reports_every_trial_and_takes_its_maximum_for_floors():
    ms = iter([9.0, 40.0, 20.0, 25.0] + [30.0] * 8)  # one slow warm-up, then ten trials
    store = torch.zeros(2**20, dtype=torch.uint8)
    seen = []

    def copy_ms(chunks):  # a fake clock: each trial's milliseconds
        seen.append(sum(c.numel() for c in chunks))
        return next(ms)

    link = measure_link("cpu", [store], "test store", trial_bytes=2**22, copy_ms=copy_ms)
    assert isinstance(link, LinkMeasurement) and link.source == "test store"
    assert seen == [2**22] * 11 and link.bytes_per_trial == 2**22  # 4 rounds over the 1 MiB store each trial
    assert len(link.trials_gbps) == 10
    assert link.max_gbps == round(2**22 / 20e6, 2) and link.min_gbps == round(2**22 / 40e6, 2)
    assert link.median_gbps == round(2**22 / 30e6, 2)
    assert link.as_dict()["trials_gbps"] == list(link.trials_gbps)


def test_the_default_measurement_takes_at_least_a_gib_per_trial_and_needs_a_gpu():
    assert measure_link("cpu") is None  # no PCIe link to measure
    store = torch.zeros(2**20, dtype=torch.uint8)
    link = measure_link("cpu", [store], copy_ms=lambda chunks: 10.0, trials=2)
    assert link.bytes_per_trial >= 2**30 and len(link.trials_gbps) == 2
