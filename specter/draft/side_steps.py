"""Draft steps queued on a side stream, all at once, their outputs kept for whoever takes the drafts."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch


class SideSteps:
    """The steps of a draft chain (an iterator whose every item queues one step on the current stream and is
    that step's output), queued on `stream` (None: run now) when made; `finish` returns every output."""

    def __init__(self, chain: Iterator[torch.Tensor], stream) -> None:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.outputs: list[torch.Tensor] = list(chain)

    def finish(self) -> list[torch.Tensor]:
        """Every step's output."""
        return self.outputs
