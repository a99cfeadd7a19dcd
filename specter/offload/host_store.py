"""Host store: the target's full-precision routed experts in (pinned) host memory, one contiguous buffer per expert."""
from __future__ import annotations

import torch

from specter.errors import SpecterError
from specter.kernels.slot_moe import row_views
from specter.offload.pinned import pin


class HostExpertStore:
    """Per MoE layer one [E, 3*I*H] host tensor; row e holds expert e's gate_up [2I, H] then down [H, I].

    One expert is therefore one contiguous copy. Pinned when the compute device is a GPU. Layers are
    allocated as they are filled, so a loader can free its own copy of each layer as it goes; a layer whose
    experts every reader takes as residual blobs can be released (`release_layer`), after which reading it
    is an error.
    """

    def __init__(self, num_layers: int, num_experts: int, hidden: int, intermediate: int,
                 dtype: torch.dtype, compute_device: torch.device) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.hidden, self.intermediate, self.dtype = hidden, intermediate, dtype
        self.numel = 3 * intermediate * hidden
        self.compute_device = torch.device(compute_device)
        self.buffers: list[torch.Tensor | None] = [None] * num_layers  # allocated as each layer arrives
        self.rows: list[tuple] = [()] * num_layers  # each layer's expert rows as views, made once
        self.released: set[int] = set()  # layers whose raw experts were let go

    @classmethod
    def for_experts(cls, experts: list, dtype: torch.dtype, compute_device: torch.device) -> HostExpertStore:
        """An empty store shaped like `experts` (a model's HybridExperts layers, in order)."""
        first = experts[0]
        return cls(len(experts), first.num_experts, first.hidden_dim, first.intermediate_dim, dtype, compute_device)

    @property
    def expert_bytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.num_layers * self.num_experts

    def put_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy a layer's experts in: gate_up [E, 2I, H], down [E, H, I] (any device)."""
        if self.buffers[layer] is None:
            self.buffers[layer] = pin(torch.empty(self.num_experts, self.numel, dtype=self.dtype), self.compute_device)
            self.rows[layer] = self.buffers[layer].unbind(0)
        gate_up_rows, down_rows = row_views(self.buffers[layer], self.intermediate)  # [E, 2I, H], [E, H, I]
        gate_up_rows.copy_(gate_up)
        down_rows.copy_(down)

    def release_layer(self, layer: int) -> None:
        """Let a layer's raw experts go (their residual blobs serve every reader from now on)."""
        self.buffers[layer], self.rows[layer] = None, ()
        self.released.add(layer)

    @property
    def holds_raw(self) -> bool:
        return not self.released

    def _check_held(self, layer: int) -> None:
        if layer in self.released:
            raise SpecterError(f"layer {layer}'s raw experts were released: this model keeps only residual blobs, "
                               f"which only Specter with residual transfer reads (keep_raw_experts=True keeps them "
                               f"for systems that read raw experts)")

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """Expert's flat buffer [3*I*H] (a view into the store)."""
        self._check_held(layer)
        return self.rows[layer][expert]

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (gate_up [2I, H], down [H, I]) of one flat expert buffer (host row or cache slot)."""
        return row_views(flat, self.intermediate)

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (gate_up [E, 2I, H], down [E, H, I]) of a whole layer."""
        self._check_held(layer)
        return row_views(self.buffers[layer], self.intermediate)
