"""The copy link's bandwidth estimate: each finished copy timed once, in issue order, over a recent window."""
from typing import NamedTuple

import torch

from specter.offload.bandwidth import BandwidthMeter
from specter.offload.streams import DeviceStreams


class Copy(NamedTuple):
    start: float
    end: float
    nbytes: int
    done: bool = True


def test_each_finished_copy_is_timed_once_and_in_flight_copies_hold_back_later_ones():
    timed = []

    def elapsed(start, end):
        timed.append(start)
        return end - start

    meter = BandwidthMeter(window=2)
    copies = [Copy(0.0, 1.0, 100), Copy(1.0, 3.0, 100), Copy(3.0, 4.0, 400, done=False), Copy(4.0, 5.0, 50)]
    finished = lambda c: c.done  # noqa: E731
    assert meter.measure(copies, finished, elapsed) == 200 / 3
    assert meter.measure(copies, finished, elapsed) == 200 / 3 and timed == [0.0, 1.0]  # nothing timed again
    copies[2] = copies[2]._replace(done=True)
    assert meter.measure(copies, finished, elapsed) == (400 + 50) / 2  # the window keeps the last two
    assert timed == [0.0, 1.0, 3.0, 4.0]
    meter.restart()
    assert meter.measure([], finished, elapsed) is None


def test_device_streams_measure_their_copies_until_reset():
    streams = DeviceStreams(torch.device("cpu"))
    assert streams.measured_bandwidth() is None
    streams.copy(torch.empty(1 << 16), torch.ones(1 << 16))
    rate = streams.measured_bandwidth()
    assert rate is not None and rate > 0
    streams.reset_stats()
    assert streams.measured_bandwidth() is None
