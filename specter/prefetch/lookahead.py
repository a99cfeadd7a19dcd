"""Expert lookahead buffer (GPU counters of the draft's routing) and the incremental routing pattern analyzer."""
from __future__ import annotations

import torch

from specter.offload.timeline import to_host


class ExpertLookaheadBuffer:
    """ELB_cnt[j, e]: how often the draft router picked expert e in MoE layer j during this window.

    int32 counters on the device, updated by scatter-add from every draft step's top-k (no host sync).
    """

    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=device)  # [L, E]

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Routing observer of HybridExperts in draft mode: add this step's top-k ids of `layer`."""
        ids = top_k_index.reshape(-1)  # [T*k]
        self.counts[layer].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def clear(self) -> None:
        self.counts.zero_()


class PatternAnalyzer:
    """At a prefetch checkpoint: per layer the top-M experts by count, copied to the host in one transfer."""

    def __init__(self, elb: ExpertLookaheadBuffer) -> None:
        self.elb = elb

    def ranking(self) -> dict[int, list[int]]:
        """Layer -> every expert the draft picked in this window, most frequent first (one D2H copy)."""
        values, experts = self.elb.counts.sort(dim=1, descending=True, stable=True)  # [L, E] each
        packed = torch.where(values > 0, experts, -1)  # [L, E], -1 = never picked
        return {layer: [e for e in row if e >= 0] for layer, row in enumerate(to_host(packed))}

    def plan(self, m: int) -> dict[int, list[int]]:
        """Layer -> the top-m experts by count (only experts with a non-zero count)."""
        return {layer: ranked[:m] for layer, ranked in self.ranking().items()}
