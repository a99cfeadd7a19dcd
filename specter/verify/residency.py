"""Verification residency manager: expert-wise target execution, cache hits first while misses stream in."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean
from typing import Any, NamedTuple

import torch

from specter.defaults import config_default
from specter.kernels.reference import combine_rows, expert_mlp
from specter.kernels.slot_moe import (
    TRITON_AVAILABLE,
    MoEWorkspace,
    align_routing,
    slot_moe_rows_reference,
    slot_moe_waves,
)
from specter.offload.eviction import RoutingCounts
from specter.offload.expert_cache import ExpertCache


@dataclass(frozen=True)
class VerifyOptions:
    """How verification streams experts: expert-wise (SpecterConfig's) or token-wise, waves of `wave` experts
    (0: half the slots, -1: every slot), and the planned loads of the next `ahead_layers` layers started when a
    layer is done."""

    expert_wise: bool = config_default("expert_wise")
    wave: int = 0
    ahead_layers: int = 2


def wave_size(option: int, slots: int) -> int:
    """Experts per verify wave: `option` (VerifyOptions.wave), half the layer's slots for 0, all of them for -1."""
    return slots if option < 0 else option or max(1, slots // 2)


class LayerPass(NamedTuple):
    """One verify layer's inputs and outputs, shared by its waves."""

    module: object  # the HybridExperts layer
    hidden: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, k]
    rows: torch.Tensor  # [T*k, H] fp32 outputs
    waves: Callable  # waves(row_of_expert [E]): the rows of the pairs routed to the experts with a pool row


class ResidencyManager:
    """The target-mode executor of every HybridExperts layer when experts are offloaded.

    Per layer, without waiting for the router: the resident experts run first (those already loaded
    before those still arriving; the slot kernel computes only the pairs routed to them); their slots
    then take, wave after wave, the experts the draft routed to in this window (the window's plan, which
    the engine hands over with `window(plan)`; usually almost all of what the target needs). A wave is at most
    half the slots, so the slots of one wave take new copies while the next computes. Only then does the host
    read the router's top-k (its copy was started before the waves were enqueued, so the GPU and the copy stream
    stay busy meanwhile): the router is authoritative, and any routed expert that neither was resident nor
    planned is loaded and computed last. A wave is one launch pair of the slot
    kernel on CUDA (tokens gathered per expert into dense tiles), the torch reference on CPU; the compute
    stream waits on ready events, never the host. Expert outputs fill (token, slot) rows that are
    combined with the routing weights at the end, so order does not change the result.

    Built per system and call with that system's VerifyOptions and kernel workspace; it counts the
    target's routing into `routing`, which the cache's popularity policy reads.
    """

    def __init__(self, cache: ExpertCache, routing: RoutingCounts, options: VerifyOptions,
                 workspace: MoEWorkspace) -> None:
        self.cache, self.routing, self.options, self.workspace = cache, routing, options, workspace
        self.slot_kernel: bool | None = None  # waves in Triton; None: on CUDA (the torch reference elsewhere)
        self.reset()

    def reset(self) -> None:
        self.demand: dict[int, set] = {}  # layer -> experts the target routed to since the last take_demand
        self.working_sets: list[int] = []  # distinct experts per (verify pass, layer)
        self.loaded_ahead: dict[int, set] = {}  # layer -> planned experts loaded while the previous layer ran
        self.host_ms = self.host_wait_ms = 0.0  # host time in verify layers, and the part waiting for routers
        self.host_load_ms = self.host_wave_ms = 0.0  # of it: issuing loads, and launching waves
        self.waves = 0  # verify waves launched (slot-kernel calls)

    def window(self, plan) -> PlannedVerify:
        """The target executor of one window's target pass: every layer verified with `plan`
        (prefetch.planner.WindowPlan, or None: load on demand)."""
        return PlannedVerify(self, plan)

    def __call__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """A target layer outside any window (a prefill, a replay): what it routes to, loaded on demand."""
        return self.verify_layer(module, hidden, top_k_index, top_k_weights, None)

    def verify_layer(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     plan) -> torch.Tensor:
        """One MoE layer's routed experts (hidden [T, H], top_k_index and top_k_weights [T, k]) with the window's
        `plan` (None: load on demand)."""
        start = time.perf_counter()
        out = self._verify_layer(module, hidden, top_k_index, top_k_weights, plan)
        self.host_ms += (time.perf_counter() - start) * 1e3
        return out

    def _verify_layer(self, module, hidden, top_k_index, top_k_weights, plan) -> torch.Tensor:
        if not self.options.expert_wise:
            routing = top_k_index.tolist()  # [T][k], the one host read of this layer
            self._observe(module, routing)
            return combine_rows(self._token_wise(module, hidden, routing), top_k_weights, hidden.dtype)
        rows = torch.zeros(top_k_index.numel(), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        self._expert_wise(module, hidden, top_k_index, rows, plan)  # rows: [T*k, H]
        return combine_rows(rows, top_k_weights, hidden.dtype)

    def _observe(self, module, routing: list[list[int]]) -> list[int]:
        """Record the router's choice of one layer (host lists [T][k]); returns the routed experts, ascending."""
        layer = module.moe_layer
        self.routing.add(layer, module.num_experts, routing)
        routed = sorted({e for token in routing for e in token})
        self.demand.setdefault(layer, set()).update(routed)
        self.working_sets.append(len(routed))
        return routed

    def _expert_wise(self, module, hidden, top_k_index, rows, window_plan) -> None:
        layer, cache = module.moe_layer, self.cache
        routing = cache.streams.read_later(top_k_index)  # [T, k], in flight while the waves are enqueued
        step = LayerPass(module, hidden, top_k_index, rows, self._layer_waves(module, hidden, top_k_index, rows))
        prefetched, ahead = cache.prefetched_experts(layer), self.loaded_ahead.pop(layer, set())
        resident = cache.protect_resident(layer)  # includes the experts loaded ahead, maybe still in flight
        plan = window_plan.load_order(layer) if window_plan is not None else []
        planned = [e for e in plan if e not in resident]  # most routed first
        if len(planned) <= cache.stream_slots - len(resident):  # all in flight at once: in expert order, so that
            planned.sort()  # grouped residual copies of neighbouring experts cross as one (`residual_group_copies`)
        ready_first = sorted(resident.items(), key=lambda pair: pair[0] in ahead)  # [(expert, slot)]
        self._stream(step, ready_first, deque(planned), ready=len(resident.keys() - ahead))
        cache.start_loads()  # nothing waits for a group's launch while the host waits for the router
        waited = time.perf_counter()
        routed = self._observe(module, routing.result().tolist())  # the one host wait of this layer
        self.host_wait_ms += (time.perf_counter() - waited) * 1e3
        hits_possible = {e: s for e, s in resident.items() if e not in ahead}
        cache.count_lookups(layer, routed, hits_possible, set(planned) | ahead, prefetched)
        computed = resident.keys() | set(planned)
        unplanned = deque(e for e in routed if e not in computed)
        self._stream(step, [], unplanned)
        cache.return_lent_rows(layer)  # spare rows lent to this layer's waves (pooled slots) serve the loads ahead
        for ahead in range(layer + 1, layer + 1 + self.options.ahead_layers):
            self._load_ahead(ahead, window_plan)
        cache.start_loads()  # the loads ahead cross while the host runs the next layer's attention

    def _layer_waves(self, module, hidden, top_k_index, rows) -> Callable:
        """The layer's wave launches over the cache's pool: the slot kernel prepared once for all its waves (its
        routing aligned once), or the torch reference."""
        pool, inter = self.cache.pool, module.intermediate_dim
        fused = self.slot_kernel if self.slot_kernel is not None else hidden.is_cuda and TRITON_AVAILABLE
        if fused:
            alignment = align_routing(top_k_index, module.num_experts, self.workspace)
            return slot_moe_waves(hidden, top_k_index, pool, inter, rows, alignment, module.act_fn, self.workspace)
        return lambda row_of_expert: slot_moe_rows_reference(hidden, top_k_index, pool, row_of_expert, inter, rows,
                                                             module.act_fn)

    def _load_ahead(self, layer: int, window_plan) -> None:
        """Start a next layer's planned loads into its slots that hold nothing it plans to use, so the
        copy stream goes on from this layer's loads instead of idling until the next layer's first wave."""
        if layer >= len(self.cache.layers) or window_plan is None:
            return
        start = time.perf_counter()
        self._load_planned_ahead(layer, window_plan)
        self.host_load_ms += (time.perf_counter() - start) * 1e3

    def _load_planned_ahead(self, layer: int, window_plan) -> None:
        plan = window_plan.load_order(layer)
        keep = frozenset(plan)
        for expert in plan:
            if self.cache.slot_of(layer, expert) is None:
                if not self.cache.load_ahead(layer, expert, keep):
                    return
                self.loaded_ahead.setdefault(layer, set()).add(expert)

    def _stream(self, step: LayerPass, current: list, pending: deque, ready: int = 0) -> None:
        """Run `current` (resident (expert, slot) pairs, the first `ready` of them loaded before this layer)
        and load and run `pending` experts, a wave at a time.

        A wave is at most half the layer's slots (or `wave` experts), so the slots of one wave take new
        copies while the next wave computes: the copy stream is not held up by the compute of a whole
        layer's worth of slots. A wave never mixes loaded experts with ones still in flight: the copies
        into the slots it frees would otherwise wait for the slowest of its copies.
        """
        layer, size = step.module.moe_layer, wave_size(self.options.wave, self.cache.stream_slots)
        size = min(size, self.cache.max_wave or size)  # coded slots: a wave's experts fit the scratch rows
        queue = deque(current)
        queue.extend(self._load_wave(layer, pending))
        while queue:
            count = min(size, len(queue), ready or size)
            ready = max(0, ready - count)
            wave = [queue.popleft() for _ in range(count)]
            self._run_wave(step, wave)
            queue.extend(self._load_wave(layer, pending))  # into the slots that wave released

    def _load_wave(self, layer: int, pending: deque) -> list[tuple[int, int]]:
        """Start copies of missing experts into every slot that is free of protection; (expert, slot) pairs."""
        start, wave = time.perf_counter(), []
        while pending:
            slot = self.cache.load_if_free(layer, pending[0])
            if slot is None:
                break
            wave.append((pending.popleft(), slot))
        if wave:
            self.cache.start_loads()  # grouped copies cross now, not when a later load fills their group
        self.host_load_ms += (time.perf_counter() - start) * 1e3
        return wave

    def _run_wave(self, step: LayerPass, wave: list[tuple[int, int]]) -> None:
        """All experts of a wave in one kernel call over the cache's pool, then release their slots."""
        if not wave:
            return
        start = time.perf_counter()
        layer, cache = step.module.moe_layer, self.cache
        self.waves += 1
        cache.streams.wait_all([cache.ready_event(layer, slot) for _, slot in wave])
        rows = cache.wave_rows(layer, wave)  # coded slots: rebuilt into scratch rows here
        step.waves(cache.streams.upload_map(step.module.num_experts, [(e, row) for (e, _), row in zip(wave, rows)]))
        cache.release_all(layer, [slot for _, slot in wave])
        self.host_wave_ms += (time.perf_counter() - start) * 1e3

    def _token_wise(self, module, hidden: torch.Tensor, routing: list[list[int]]) -> torch.Tensor:
        """Ablation: conventional chronological verification, one GEMV per (token, slot), loading on demand;
        the rows [T*k, H] (fp32) of the pairs, stacked once."""
        layer, k, outs = module.moe_layer, len(routing[0]), []
        for pair, expert in enumerate(e for token in routing for e in token):
            slot = self.cache.acquire(layer, expert)
            self.cache.streams.wait(self.cache.ready_event(layer, slot))
            gate_up, down = self.cache.weights(layer, slot)
            token = hidden[pair // k: pair // k + 1]  # [1, H]
            outs.append(expert_mlp(token, gate_up, down, module.act_fn))  # [1, H]
            self.cache.release(layer, slot)
        return torch.cat(outs).float()

    def take_demand(self) -> dict[int, set]:
        """The target's routing since the last call (one verify window): layer -> experts."""
        demand, self.demand = self.demand, {}
        return demand

    def stats(self) -> dict:
        sets = self.working_sets
        return {
            "working_set_mean": mean(sets) if sets else float("nan"),
            "verify_host_ms": self.host_ms,  # host time in the MoE layers of target passes
            "verify_host_wait_ms": self.host_wait_ms,  # of it: waiting for routers' top-k
            "verify_host_load_ms": self.host_load_ms,  # issuing expert loads (a grouped decode's launch included)
            "verify_host_wave_ms": self.host_wave_ms,  # launching verify waves
            "verify_waves": self.waves,
        }


@dataclass(frozen=True)
class PlannedVerify:
    """The target executor of one window's target pass (`ResidencyManager.window`): each MoE layer verified by
    `manager` with the window's `plan`."""

    manager: ResidencyManager
    plan: Any

    def __call__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.manager.verify_layer(module, hidden, top_k_index, top_k_weights, self.plan)
