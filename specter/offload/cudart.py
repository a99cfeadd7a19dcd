"""CUDA runtime calls that torch does not make cheap: page-locking host memory in place, and host-to-device
copies issued in one call (`cudaMemcpyAsync` through ctypes) instead of torch's `copy_`."""
from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import torch

from specter.errors import SpecterError

REGISTER_MIN_BYTES = 64 * 2**20  # `pin` registers tensors this large in place instead of copying them
COPY_ISSUES = ("torch", "cudart")  # how DeviceStreams issues an expert's host-to-device copy
HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


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


class RuntimeCopies:
    """`copy(dst, src, stream)`: src's bytes into dst on `stream` by one `cudaMemcpyAsync` call, without
    torch's dispatch, checks and stream switch (the host's cost per expert load). Both tensors contiguous,
    src in page-locked host memory that outlives the copy (torch's copy_ would also hold a block of its
    pinned allocator until then), dst on the device: what the offload runtime's loads are (the host and
    residual stores' buffers live as long as the model)."""

    def __init__(self, library) -> None:
        self.memcpy = library.cudaMemcpyAsync
        self.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.memcpy.restype = ctypes.c_int

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        nbytes = src.numel() * src.element_size()
        if nbytes > dst.numel() * dst.element_size():
            raise SpecterError(f"a copy of {nbytes} bytes does not fit its {dst.numel() * dst.element_size()}-byte "
                               f"destination")
        status = self.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, HOST_TO_DEVICE, stream.cuda_stream)
        if status != 0:
            raise SpecterError(f"cudaMemcpyAsync of {nbytes} bytes failed with CUDA error {status}")


def runtime_library_path(maps: str) -> str | None:
    """The CUDA runtime library (libcudart) this process has loaded, from /proc/self/maps' text; None if
    none (torch linked it statically, or no CUDA)."""
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith("libcudart.so"):
            return path
    return None


def copy_issuer(issue: str):
    """The copy function DeviceStreams uses for `issue` ("torch": None, torch's `copy_`; "cudart":
    RuntimeCopies over the process's libcudart); a clear error when the library is not loaded."""
    if issue not in COPY_ISSUES:
        raise SpecterError(f"copy_issue must be one of {', '.join(COPY_ISSUES)}, got {issue!r}")
    if issue == "torch" or not torch.cuda.is_available():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    path = runtime_library_path(maps)
    if path is None:
        raise SpecterError("copy_issue=cudart needs the CUDA runtime library (libcudart) that torch loads; this "
                           "process has none loaded (use copy_issue=torch)")
    return RuntimeCopies(ctypes.CDLL(path))
