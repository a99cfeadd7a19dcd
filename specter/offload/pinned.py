"""Page-locked host memory: the host stores' tensors (large ones registered in place) and the link's measured copy rate."""
from __future__ import annotations

import weakref

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


def pinned_h2d_gbps(device: str | torch.device, chunk_mb: int = 32, chunks: int = 8, rounds: int = 5) -> float | None:
    """The pinned host-to-device copy rate of `device` in GB/s (1e9 bytes), the median of `rounds` rounds of
    `chunks` back-to-back copies of `chunk_mb` MB (an expert-sized copy), after one warm-up round; None
    where `device` is not a CUDA GPU (no PCIe link to measure)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    src = torch.empty(chunk_mb * 2**20, dtype=torch.uint8).pin_memory()
    dst = [torch.empty_like(src, device=device) for _ in range(2)]
    rates = []
    for _ in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(chunks):
            dst[i % 2].copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(chunks * src.numel() / (start.elapsed_time(end) * 1e6))  # bytes per ms / 1e6 = GB/s
    return round(sorted(rates[1:])[rounds // 2], 2)
