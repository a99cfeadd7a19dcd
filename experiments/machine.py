"""What a run's timings ran under: host load, the host's time per small torch op and the GPU's clock."""
from __future__ import annotations

import os
import statistics
import time

import torch

from specter.errors import first_line


def machine_state(device: str | torch.device | None = None) -> dict:
    """Host load (1-minute average, cores), the host's time per small torch op on the run's `device` (None or
    "auto": CUDA where there is one) and, on CUDA, the GPU's clock: what the timings ran under. The link's rate is
    measured later, after the warm-ups (experiments.link)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {"load_average_1min": load, "cpu_cores": os.cpu_count(), "host_op_us": host_op_us(torch.device(device))}
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


def load_note(state: dict, link: dict | None = None) -> str:
    """`, host load 0.4/2 cores, 3.6 us per host op` (and the GPU clock, and the `link` measurement's max, median
    and min rate) for the printed header."""
    load, op = state.get("load_average_1min"), state.get("host_op_us")
    note = "" if load is None else f", host load {load:.1f}/{state.get('cpu_cores')} cores"
    note += "" if op is None else f", {op} us per host op"
    clock = state.get("gpu_clock_mhz")
    note += f", GPU clock {clock} MHz" if isinstance(clock, (int, float)) else ""
    if not link:
        return note
    return note + (f", H2D {link['max_gbps']} GB/s pinned (max of {len(link['trials_gbps'])} trials of "
                   f"{link['bytes_per_trial'] / 2**30:.1f} GiB; median {link['median_gbps']}, min {link['min_gbps']})")


def peak_memory() -> dict:
    """This process's peak memory so far, in GB: `host` its resident set (pinned host memory included), `gpu` the
    most torch held allocated on the current GPU (None without one)."""
    import resource  # Unix only; the harness runs on Linux
    host_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gpu = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    return {"host_gb": round(host_kb * 1024 / 1e9, 2), "gpu_gb": None if gpu is None else round(gpu, 2)}
