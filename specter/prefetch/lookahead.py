"""Expert lookahead buffer (GPU counters of the draft's routing) and the incremental routing pattern analyzer."""
from __future__ import annotations

import torch

from specter.offload.host_reads import HostRead
from specter.offload.streams import DeviceStreams
from specter.device.timeline import to_host


class ExpertLookaheadBuffer:
    """ELB_cnt[j, e]: how often the draft router picked expert e in MoE layer j during this window.

    int32 counters on the device, updated by scatter-add from every draft step's top-k (no host sync).
    """

    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=device)  # [L, E]
        self._ones = torch.ones(4096, dtype=torch.int32, device=device)  # addends, kept (one kernel less a step)
        self._retired: list[torch.Tensor] = []  # outgrown addends stay alive: a captured graph may read them
        self.tap_layer, self.tap = -1, None  # see set_tap

    def set_tap(self, layer: int, tap) -> None:
        """Copy the counters of layers 0..`layer` to `tap` (a streams.HostTap) as soon as a draft step has
        counted `layer`, so the planner can act on early layers before the step ends (before capture)."""
        self.tap_layer, self.tap = layer, tap

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Routing observer of HybridExperts in draft mode: add this step's top-k ids of `layer`."""
        ids = top_k_index.reshape(-1)  # [T*k]
        if ids.numel() > self._ones.numel():
            self._retired.append(self._ones)
            self._ones = torch.ones(ids.numel(), dtype=torch.int32, device=ids.device)
        self.counts[layer].index_add_(0, ids, self._ones[: ids.numel()])
        if layer == self.tap_layer:
            self.tap.record(self.counts[: layer + 1])  # [layer + 1, E]

    def clear(self) -> None:
        self.counts.zero_()


class PatternAnalyzer:
    """At a prefetch checkpoint: per layer the experts the draft picked, most frequent first, copied to
    the host in one transfer (now, or in the background so that the next draft step is already queued)."""

    def __init__(self, elb: ExpertLookaheadBuffer) -> None:
        self.elb = elb

    def _packed(self) -> torch.Tensor:
        values, experts = self.elb.counts.sort(dim=1, descending=True, stable=True)  # [L, E] each
        return torch.stack([torch.where(values > 0, experts, -1), values])  # [2, L, E]; -1 = never picked

    def read_later(self, streams: DeviceStreams) -> Ranking:
        """The ranking as it stands now, copied to the host in the background (read on first use)."""
        packed = self._packed()
        return Ranking(streams.read_later(packed if packed.is_cuda else packed.clone()))

    def early_rows(self) -> dict[int, list[tuple[int, int]]] | None:
        """Layer -> [(expert, count)] of the early layers as the counters' tap last copied them (waits for
        that copy), most frequent first; None without a tap."""
        if self.elb.tap is None:
            return None
        values, experts = self.elb.tap.result().sort(dim=1, descending=True, stable=True)  # [h + 1, E] each
        return {layer: [(e, c) for e, c in zip(es, cs) if c > 0]
                for layer, (es, cs) in enumerate(zip(experts.tolist(), values.tolist()))}

    def ranking(self) -> dict[int, list[tuple[int, int]]]:
        """Layer -> [(expert, count)] of every expert the draft picked in this window, most frequent first
        (one D2H copy, now)."""
        experts, counts = to_host(self._packed())  # [L, E] each
        return _rows(experts, counts)


class Ranking:
    """A ranking of the draft's routing in flight to the host: layer -> [(expert, count)], most frequent first."""

    def __init__(self, read: HostRead) -> None:
        self._read, self._rows = read, None

    @classmethod
    def of(cls, experts: dict[int, list[int]]) -> Ranking:
        """A ranking known on the host: layer -> experts, most frequent first (counts unknown: 0)."""
        ranking = cls(None)
        ranking._rows = {layer: [(e, 0) for e in row] for layer, row in experts.items()}
        return ranking

    def rows(self) -> dict[int, list[tuple[int, int]]]:
        if self._rows is None:
            self._rows = _rows(*self._read.result().tolist())  # [L, E] each
        return self._rows

    def experts(self, layer: int) -> list[int]:
        """The experts of one layer, most frequent first (waits for the copy once)."""
        return [e for e, _ in self.rows().get(layer, ())]


def _rows(experts: list[list[int]], counts: list[list[int]]) -> dict[int, list[tuple[int, int]]]:
    """Layer -> [(expert, count)] from sorted [L, E] experts (-1: never picked) and counts."""
    return {layer: [(e, c) for e, c in zip(es, cs) if e >= 0] for layer, (es, cs) in enumerate(zip(experts, counts))}
