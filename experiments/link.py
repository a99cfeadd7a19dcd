"""The run's pinned host-to-device bandwidth: measured once after the warm-ups, from the model's own pinned
memory, and checked against what the systems' copies moved."""
from __future__ import annotations

from collections.abc import Callable

import torch

import specter.offload.pinned as pinned
from specter.offload.pinned import LinkMeasurement


class RunLink:
    """Measures the link once per process (`measure`, called after the warm-ups, the GPU otherwise idle) from
    `sources()` (the run's pinned host tensors); `floor_gbps` is then the maximum of its trials, every row's I/O
    floor rate (None before the measurement and without a GPU). `on_measured(measurement)` persists it."""

    def __init__(self, device: str | torch.device, sources: Callable[[], list[torch.Tensor]] = list,
                 on_measured: Callable[[LinkMeasurement], None] | None = None) -> None:
        self.device, self.sources, self.on_measured = device, sources, on_measured
        self.measurement: LinkMeasurement | None = None
        self.measured = False

    def measure(self) -> LinkMeasurement | None:
        """Measure now unless done already (specter.offload.pinned.measure_link); None without a GPU."""
        if not self.measured:
            self.measured = True
            sources = self.sources()
            self.measurement = (pinned.measure_link(self.device, sources, "the run's host store") if sources
                                else pinned.measure_link(self.device))
            if self.measurement is not None and self.on_measured is not None:
                self.on_measured(self.measurement)
        return self.measurement

    @property
    def floor_gbps(self) -> float | None:
        return None if self.measurement is None else self.measurement.max_gbps

    def as_dict(self) -> dict | None:
        return None if self.measurement is None else self.measurement.as_dict()


def pinned_sources(model) -> list[torch.Tensor]:
    """The pinned host tensors a run reads its offloaded experts from: the host store's layers, or the residual
    blobs' where the raw experts were let go; [] when every expert is on the GPU."""
    store = getattr(model, "host_store", None)
    raw = [] if store is None else [b for b in store.buffers if b is not None]
    runtime = getattr(model, "offload", None)
    residuals = None if runtime is None else runtime.residuals
    return raw if raw or residuals is None else list(residuals.buffers)
