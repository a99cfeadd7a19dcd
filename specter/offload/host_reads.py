"""Small device-to-host reads the host waits for one at a time: an async copy (HostRead) and a copy a captured
CUDA graph can signal (HostTap)."""
from __future__ import annotations

import torch


class HostRead:
    """A device-to-host copy in flight (see DeviceStreams.read_later)."""

    def __init__(self, host: torch.Tensor, done) -> None:
        self.host, self.done = host, done

    def result(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


def read_when_reached(tensor: torch.Tensor) -> HostRead:
    """A small tensor's copy to the host queued on the current stream (pinned, async): `.result()` waits for
    the stream to reach this point alone, not for what is queued after it. On the CPU the tensor itself."""
    if not tensor.is_cuda:
        return HostRead(tensor, None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostRead(host, done)


def recorded_event(cuda: bool):
    """An event recorded on the current stream (None off CUDA)."""
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostTap:
    """A small device tensor copied to one pinned host buffer each time `record` runs, even as a node of a
    captured CUDA graph (its event is external, so the host can wait for the graph to reach it)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, cuda: bool) -> None:
        self.event = torch.cuda.Event(external=True) if cuda else None
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)

    @torch.compiler.disable  # inside a torch.compile'd draft step: a graph break, run as written (and captured)
    def record(self, tensor: torch.Tensor) -> None:
        """Copy `tensor` to the host buffer when the current stream gets here (synchronous on CPU)."""
        self.host.copy_(tensor, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def result(self) -> torch.Tensor:
        """The host buffer once the latest recorded copy is done (the host waits for that point alone)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
