"""Page-locked host memory for the host stores: large tensors registered in place, small ones pinned copies."""
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
