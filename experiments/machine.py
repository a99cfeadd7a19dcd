"""What a run's timings ran under: host load, the host's time per small torch op, the GPU's clock and H2D rate."""
from __future__ import annotations

import os
import statistics
import time

import torch

from specter.errors import first_line
from specter.offload.pinned import pinned_h2d_gbps


def machine_state(device: str | torch.device | None = None) -> dict:
    """Host load (1-minute average, cores), the host's time per small torch op on the run's `device` (None or
    "auto": CUDA where there is one) and, on CUDA, the GPU's clocks and its pinned host-to-device copy rate
    (`h2d_gbps`, GB/s; None without a GPU): what the timings ran under."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {"load_average_1min": load, "cpu_cores": os.cpu_count(), "host_op_us": host_op_us(torch.device(device)),
             "h2d_gbps": pinned_h2d_gbps(device)}
    if torch.cuda.is_available():
        try:
            state["gpu_clock_mhz"] = torch.cuda.clock_rate()
        except Exception as err:  # noqa: BLE001  (needs NVML; without it only the reading is lost)
            state["gpu_clock_mhz"] = f"unavailable: {first_line(err) or type(err).__name__}"
    return state


def host_op_us(device: torch.device, ops: int = 200, rounds: int = 5) -> float:
    """The host's microseconds to issue one tiny in-place add on `device` (Python, dispatch and, on CUDA,
    the kernel launch), the median of `rounds` rounds of `ops`: what eagerly run systems pay per op, so
    their TPOT follows it from host to host."""
    x = torch.zeros(1, device=device)
    times = []
    for _ in range(rounds + 1):  # the first round warms up
        start = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        times.append((time.perf_counter() - start) * 1e6 / ops)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return round(statistics.median(times[1:]), 2)


def busy_warning(state: dict, share: float = 0.75) -> str | None:
    """A warning line when the host's load average exceeds `share` of its cores (timings inflate)."""
    load, cores = state.get("load_average_1min"), state.get("cpu_cores") or 1
    if load is None or load <= share * cores:
        return None
    return (f"warning: this machine was busy when the run started (host load {load:.1f}/{cores} cores): "
            f"its timings are inflated; run.json records the load")


def load_note(state: dict) -> str:
    """`, host load 0.4/2 cores, 3.6 us per host op` (and the GPU clock) for the printed header."""
    load, op = state.get("load_average_1min"), state.get("host_op_us")
    note = "" if load is None else f", host load {load:.1f}/{state.get('cpu_cores')} cores"
    note += "" if op is None else f", {op} us per host op"
    clock, gbps = state.get("gpu_clock_mhz"), state.get("h2d_gbps")
    note += f", GPU clock {clock} MHz" if isinstance(clock, (int, float)) else ""
    return note + (f", H2D {gbps} GB/s pinned" if gbps else "")
