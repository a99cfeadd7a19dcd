"""specter.offload.cudart: copies issued by one CUDA runtime call, on CPU through fakes (the GPU test is in
test_gpu.py), and where the runtime library is found."""
import ctypes

import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.offload.cudart import HOST_TO_DEVICE, RuntimeCopies, copy_issuer, runtime_library_path
from tests.test_decode_groups import LOG, grouped, streams  # noqa: F401  (the fake-CUDA fixture)

MAPS = """7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6
7f02-7f03 r-xp 00000000 08:01 456 /site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f04-7f05 rw-p 00000000 00:00 0
"""


def test_the_runtime_library_is_the_loaded_libcudart():
    assert runtime_library_path(MAPS) == "/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert runtime_library_path(MAPS.replace("libcudart", "libcublas")) is None
    assert runtime_library_path("") is None


class FakeFunction:
    """A ctypes function as a recorder that returns `status` (argtypes and restype settable)."""

    def __init__(self, status: int) -> None:
        self.calls, self.status = [], status

    def __call__(self, *args):
        self.calls.append(args)
        return self.status


class FakeLibrary:
    def __init__(self, status: int = 0) -> None:
        self.cudaMemcpyAsync = FakeFunction(status)
        self.calls = self.cudaMemcpyAsync.calls


class Stream:
    cuda_stream = 1234


def test_a_runtime_copy_is_one_call_with_pointers_bytes_kind_and_stream():
    library = FakeLibrary()
    copies = RuntimeCopies(library)
    dst, src = torch.zeros(10, dtype=torch.float16), torch.ones(6, dtype=torch.float16)
    copies(dst, src, Stream())
    assert library.calls == [(dst.data_ptr(), src.data_ptr(), 12, HOST_TO_DEVICE, 1234)]
    assert library.cudaMemcpyAsync.restype is ctypes.c_int and len(library.cudaMemcpyAsync.argtypes) == 5
    with pytest.raises(SpecterError, match="does not fit its 8-byte destination"):
        copies(torch.zeros(4, dtype=torch.float16), src, Stream())
    with pytest.raises(SpecterError, match="failed with CUDA error 11"):
        RuntimeCopies(FakeLibrary(status=11))(dst, src, Stream())


def test_copy_issue_is_checked_and_torch_needs_nothing():
    assert copy_issuer("torch") is None
    with pytest.raises(SpecterError, match="copy_issue must be one of torch, cudart"):
        copy_issuer("dma")
    with pytest.raises(SpecterError, match="copy_issue must be 'torch' or 'cudart'"):
        specter.SpecterConfig(copy_issue="dma")


def test_streams_issue_raw_and_residual_copies_through_h2d_between_their_events(streams):  # noqa: F811
    issued = []

    def h2d(dst, src, stream):
        issued.append((stream.name, src.numel()))
        LOG.append(("h2d", stream.name, None))
        dst[:src.numel()].copy_(src.view(dst.dtype) if src.dtype != dst.dtype else src)

    streams.h2d = h2d
    rows = torch.zeros(4, 16, dtype=torch.int32)
    ready = streams.copy(rows[0], torch.full((16,), 7, dtype=torch.int32))
    assert torch.equal(rows[0], torch.full((16,), 7, dtype=torch.int32))
    streams.copy_decoded(rows[1], torch.full((5,), 3, dtype=torch.int32), None, 16, group=grouped("L", 1), member=0)
    assert issued == [("copy", 16), ("copy", 5)] and torch.equal(rows[1][:5], torch.full((5,), 3, dtype=torch.int32))
    kinds = [(kind, stream) for kind, stream, _ in LOG if kind in ("record", "h2d")]
    assert kinds[:3] == [("record", "copy"), ("h2d", "copy"), ("record", "copy")]  # start, copy, ready
    assert ready.stream.name == "copy"
