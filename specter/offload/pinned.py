"""Page-locked host memory: the host stores' tensors (large ones registered in place) and the link's measured copy rate."""
from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


REGISTER_MIN_BYTES = 64 * 2**20  # `pin` registers tensors this large in place instead of copying them


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked host memory when the compute device is a GPU (async H2D needs it); may pin `tensor` itself.

    A large contiguous tensor is registered in place (cudaHostRegister, exact size; unregistered when the
    tensor is collected): torch's pinned allocator rounds every block up to a power of two, which costs a
    dsv2 host-store layer (1.1 GB) a 2 GB block and a Mixtral layer (2.8 GB) 4 GB. Smaller tensors, or a
    failed registration, take a pinned copy.
    """
    if torch.device(device).type != "cuda":
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= REGISTER_MIN_BYTES and tensor.is_contiguous() and register_in_place(tensor):
        return tensor
    return tensor.pin_memory()


def register_in_place(tensor: torch.Tensor) -> bool:
    """Page-lock `tensor`'s memory where it is (True on success); a finalizer unregisters it."""
    cudart, ptr = torch.cuda.cudart(), tensor.data_ptr()
    if int(cudart.cudaHostRegister(ptr, tensor.numel() * tensor.element_size(), 0)) != 0:
        return False
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return True


LINK_TRIAL_BYTES = 2**30  # bytes each bandwidth trial copies
LINK_CHUNK_BYTES = 64 * 2**20  # bytes one copy of a trial moves (a slice of the run's own pinned memory)
LINK_TRIALS, LINK_WARMUPS = 10, 1


@dataclass(frozen=True)
class LinkMeasurement:
    """Pinned host-to-device copy rates (GB/s, 1e9 bytes) of `trials` timed trials of `bytes_per_trial` each,
    copied from `source`; floors use the maximum, the fastest the link was seen to move."""

    trials_gbps: tuple[float, ...]
    bytes_per_trial: int
    source: str

    @property
    def max_gbps(self) -> float:
        return max(self.trials_gbps)

    @property
    def median_gbps(self) -> float:
        return round(statistics.median(self.trials_gbps), 2)

    @property
    def min_gbps(self) -> float:
        return min(self.trials_gbps)

    def as_dict(self) -> dict:
        return {"max_gbps": self.max_gbps, "median_gbps": self.median_gbps, "min_gbps": self.min_gbps,
                "trials_gbps": list(self.trials_gbps), "bytes_per_trial": self.bytes_per_trial, "source": self.source}


def trial_chunks(sources: Sequence[torch.Tensor], trial_bytes: int = LINK_TRIAL_BYTES,
                 chunk_bytes: int = LINK_CHUNK_BYTES) -> list[torch.Tensor]:
    """Byte views of `sources` (host tensors), at most `chunk_bytes` each, taken in order and round again
    until they add up to at least `trial_bytes`: the copies of one trial."""
    views = [t.reshape(-1).view(torch.uint8) for t in sources if t.numel() > 0 and t.is_contiguous()]
    pieces = [v[i:i + chunk_bytes] for v in views for i in range(0, v.numel(), chunk_bytes)]
    if not pieces:
        raise ValueError("no host memory to copy from")
    chunks, total = [], 0
    while total < trial_bytes:
        piece = pieces[len(chunks) % len(pieces)]
        chunks.append(piece)
        total += piece.numel()
    return chunks


def time_trials(copy_ms: Callable[[], float], trials: int = LINK_TRIALS, warmups: int = LINK_WARMUPS) -> list[float]:
    """`copy_ms()` (one trial's milliseconds) run `warmups` times untimed, then `trials` times."""
    for _ in range(warmups):
        copy_ms()
    return [copy_ms() for _ in range(trials)]


def measure_link(device: str | torch.device, sources: Sequence[torch.Tensor] = (), source: str = "host memory",
                 trials: int = LINK_TRIALS, warmups: int = LINK_WARMUPS, trial_bytes: int = LINK_TRIAL_BYTES,
                 copy_ms: Callable[[list[torch.Tensor]], float] | None = None) -> LinkMeasurement | None:
    """The pinned host-to-device bandwidth of `device`: `trials` trials (after `warmups`), each copying at least
    `trial_bytes` from `sources` (pinned host tensors: the run's own; a pinned scratch buffer where there are
    none). `copy_ms(chunks)` times one trial (default: CUDA events on the current stream). None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" and copy_ms is None:
        return None
    if not sources:
        sources, source = [pin(torch.empty(min(trial_bytes, 4 * LINK_CHUNK_BYTES), dtype=torch.uint8), device)], \
            "a pinned scratch buffer"
    chunks = trial_chunks(sources, trial_bytes)
    nbytes = sum(c.numel() for c in chunks)
    timer = copy_ms or cuda_copy_ms(device)
    times = time_trials(lambda: timer(chunks), trials, warmups)
    return LinkMeasurement(tuple(round(nbytes / (ms * 1e6), 2) for ms in times), nbytes, source)


def cuda_copy_ms(device: torch.device) -> Callable[[list[torch.Tensor]], float]:
    """A trial timer: `chunks` copied back to back into one device buffer, timed with CUDA events."""
    buffers: list[torch.Tensor] = []

    def copy_ms(chunks: list[torch.Tensor]) -> float:
        if not buffers:
            buffers.append(torch.empty(max(c.numel() for c in chunks), dtype=torch.uint8, device=device))
        dst = buffers[0]
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for chunk in chunks:
            dst[:chunk.numel()].copy_(chunk, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return copy_ms
