"""Verification residency manager: expert-wise target execution, cache hits first while misses stream in."""
from __future__ import annotations

from collections import deque

import torch

from specter.kernels.reference import combine_rows, expert_mlp, group_by_expert
from specter.offload.expert_cache import ExpertCache


class ResidencyManager:
    """The target-mode executor of every HybridExperts layer when experts are offloaded.

    Per layer: the router's top-k is authoritative; the needed experts split into cache hits and
    misses; hits are protected and computed first (tokens gathered per expert into one GEMM), misses
    are loaded into unprotected slots on the copy stream and join the compute queue as their copies
    finish (checked without blocking; the compute stream waits on the ready event, never the host).
    Every expert's output is written to its (token, slot) rows and combined with the routing weights
    at the end, so the result does not depend on the execution order.
    """

    def __init__(self, cache: ExpertCache, expert_wise: bool = True) -> None:
        self.cache = cache
        self.expert_wise = expert_wise
        self.demand: dict[int, set] = {}  # layer -> experts the target routed to since the last reset
        self.working_sets: list[int] = []  # distinct experts per (verify pass, layer)

    def __call__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        layer = module.moe_layer
        groups = group_by_expert(top_k_index, module.num_experts)  # one bounded host read per layer
        self.demand.setdefault(layer, set()).update(groups.experts)
        self.working_sets.append(len(groups.experts))
        rows = hidden.new_zeros(top_k_index.numel(), hidden.shape[-1])  # [T*k, H]
        work = list(zip(groups.experts, groups.token_idx, groups.weight_idx))
        if self.expert_wise:
            self._expert_wise(layer, module.act_fn, hidden, work, rows)
        else:
            self._token_wise(layer, module.act_fn, hidden, top_k_index, rows)
        return combine_rows(rows, top_k_weights, hidden.dtype)

    def _expert_wise(self, layer: int, act, hidden: torch.Tensor, work: list, rows: torch.Tensor) -> None:
        cache = self.cache
        hits = deque((e, tok, w, cache.acquire(layer, e)) for e, tok, w in work if cache.slot_of(layer, e) is not None)
        pending = deque(item for item in work if cache.slot_of(layer, item[0]) is None)
        loading: deque = deque()
        self._issue_loads(layer, pending, loading)
        while hits or loading:
            e, tok, w, slot = hits.popleft() if hits else self._next_ready(layer, loading)
            self._compute(layer, slot, act, hidden, tok, w, rows)
            self._issue_loads(layer, pending, loading)

    def _issue_loads(self, layer: int, pending: deque, loading: deque) -> None:
        """Start copies for missing experts while an unprotected slot exists."""
        while pending and self.cache.has_free_slot(layer):
            e, tok, w = pending.popleft()
            loading.append((e, tok, w, self.cache.acquire(layer, e)))

    def _next_ready(self, layer: int, loading: deque):
        """The first loading expert whose copy has finished, else the oldest (non-blocking check)."""
        for i, item in enumerate(loading):
            if self.cache.streams.is_ready(self.cache.ready_event(layer, item[3])):
                del loading[i]
                return item
        return loading.popleft()

    def _compute(self, layer: int, slot: int, act, hidden, tok, w, rows) -> None:
        self.cache.streams.wait(self.cache.ready_event(layer, slot))
        gate_up, down = self.cache.weights(layer, slot)
        rows[w] = expert_mlp(hidden[tok], gate_up, down, act).to(rows.dtype)  # [n_e, H]
        self.cache.release(layer, slot)

    def _token_wise(self, layer: int, act, hidden: torch.Tensor, top_k_index: torch.Tensor, rows) -> None:
        """Ablation: conventional chronological verification, one GEMV per (token, slot), loading on demand."""
        k = top_k_index.shape[1]
        for flat, e in enumerate(top_k_index.reshape(-1).tolist()):
            tok = torch.tensor([flat // k], device=hidden.device)
            slot = self.cache.acquire(layer, e)
            self._compute(layer, slot, act, hidden, tok, torch.tensor([flat], device=hidden.device), rows)

    def reset(self) -> None:
        self.demand, self.working_sets = {}, []

    def take_demand(self) -> dict[int, set]:
        """The target's routing since the last call (one verify window), cleared."""
        demand, self.demand = self.demand, {}
        return demand
