"""Peak bytes of the tensors an operation creates and keeps alive at once (a dispatch-mode tracker, any device)."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside the block: every storage an op creates counts until it is freed; `peak` is the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:  # views and in-place results allocate nothing
            if isinstance(tensor, torch.Tensor) and not tensor._is_view() \
                    and tensor.untyped_storage().data_ptr() not in inputs:
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
