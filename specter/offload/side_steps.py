"""Draft steps queued on a side stream a few at a time, so that a long queue of them cannot hold up the host."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext

import torch

from specter.offload.host_reads import recorded_event


class SideSteps:
    """The steps of a draft chain (an iterator whose every item queues one step on the current stream and is
    that step's output) queued on `stream`.

    With `in_flight` > 0 on CUDA, `advance` queues steps while fewer than `in_flight` of those it queued are
    unfinished (the host queries their events, it never waits): a captured draft step is a graph of about a
    thousand kernels queued on the device by one host call (what queueing them costs the host: docs/design.md,
    "Its steps in flight"). Otherwise (in_flight 0, or no stream) every step is queued at once. `finish`
    queues the steps not yet queued and returns every output; steps never queued cost nothing.
    """

    def __init__(self, chain: Iterator[torch.Tensor], stream, in_flight: int) -> None:
        self.chain, self.stream = chain, stream
        self.in_flight = in_flight if stream is not None else 0
        self.outputs: list[torch.Tensor] = []
        self.unfinished: deque = deque()  # events of queued steps, oldest first
        self.done = False
        if self.in_flight == 0:
            self.finish()

    def advance(self) -> None:
        """Queue steps until `in_flight` are unfinished or none are left."""
        while self.unfinished and self.unfinished[0].query():
            self.unfinished.popleft()
        while len(self.unfinished) < self.in_flight and self._queue_one():
            pass

    def finish(self) -> list[torch.Tensor]:
        """Every step's output, the steps not yet queued queued now."""
        while self._queue_one():
            pass
        self.unfinished.clear()
        return self.outputs

    def _queue_one(self) -> bool:
        if self.done:
            return False
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            output = next(self.chain, None)
            if output is None:
                self.done = True
                return False
            self.outputs.append(output)
            if self.in_flight:
                self.unfinished.append(recorded_event(True))
        return True
