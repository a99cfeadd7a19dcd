"""Mixtral-Offloading (MO-SC, MO-SM): token-by-token decoding, per-layer LRU expert caches swapped through staging buffers."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from baselines.target_only import TargetOnly
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.inputs import check_prompt, is_batch
from specter.kernels.reference import combine_rows, expert_mlp, group_by_expert
from specter.metrics import GenerationResult, h2d_split
from specter.models.hybrid import HybridMoEModel
from specter.device.budget import MemoryPlan, plan_memory, specter_slots
from specter.offload.host_store import HostExpertStore
from specter.offload.runtime import move_experts_to_store
from specter.offload.streams import DeviceStreams

STAGING_BUFFERS = 4  # the original's default buffer_size; at most STAGING_BUFFERS - 1 swaps in flight per layer


def same_memory_slots(slots: int, plan: MemoryPlan) -> int:
    """MO-SM's FP slots per layer: Specter's `slots` plus those its INT4 draft bytes pay for, at most every expert."""
    extra = plan.draft_bytes // (plan.num_moe_layers * plan.expert_bytes)
    return min(slots + extra, plan.num_experts)


class LayerLRU:
    """One layer's residency: expert -> slot in LRU order (least recent first), free slots, experts in use."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reset()

    def reset(self) -> None:
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident expert -> slot, least recently used first
        self.free = deque(range(self.size))
        self.busy: set[int] = set()  # experts the running layer has looked up and not computed yet

    def lookup(self, expert: int) -> bool:
        """Mark `expert` used by the running layer (most recent if resident); True on a hit."""
        self.busy.add(expert)
        if expert in self.slot_of:
            self.slot_of.move_to_end(expert)
            return True
        return False

    def can_admit(self) -> bool:
        return bool(self.free) or any(e not in self.busy for e in self.slot_of)

    def admit(self, expert: int) -> tuple[int, int | None]:
        """A slot for a missing expert: a free one, else the least recently used idle expert's; (slot, evicted)."""
        if self.free:
            slot, evicted = self.free.popleft(), None
        else:
            evicted = next(e for e in self.slot_of if e not in self.busy)
            slot = self.slot_of.pop(evicted)
        self.slot_of[expert] = slot  # most recently used
        return slot, evicted

    def done(self, expert: int) -> None:
        self.busy.discard(expert)


@dataclass
class Buffer:
    """One expert's flat device buffer [3*I*H] and its (gate_up [2I, H], down [H, I]) views, made once."""

    data: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class SwapCache:
    """`slots` device buffers per MoE layer plus a few staging buffers shared by all layers (the original's design).

    A miss copies the expert from the host store into the staging buffer at the head of the queue; that
    buffer becomes the slot, and the evicted slot's buffer goes to the tail (pointers move, no device
    copy). Copies and kernels share the compute stream, as the original issues them on one stream: each
    copy runs after the kernels that last read its buffer and before those that read it next, so loads
    never overlap compute and no event orders them. The host store is never written (it holds every
    expert), so unlike the original no evicted expert is copied back to the host (one D2H copy per miss
    fewer: the baseline is not made slower than it is).
    """

    def __init__(self, store: HostExpertStore, slots: int, device: torch.device, staging: int) -> None:
        self.store, self.streams = store, DeviceStreams(device)
        self.slots = [[self._new(device) for _ in range(slots)] for _ in range(store.num_layers)]
        self.staging = deque(self._new(device) for _ in range(staging))
        self.lru = [LayerLRU(slots) for _ in range(store.num_layers)]
        self.reset()

    def _new(self, device) -> Buffer:
        data = torch.empty(self.store.numel, dtype=self.store.dtype, device=device)
        return Buffer(data, *self.store.split(data))

    @property
    def device_bytes(self) -> int:
        count = sum(len(layer) for layer in self.slots) + len(self.staging)
        return count * self.store.expert_bytes

    def reset(self) -> None:
        """Empty slots and zeroed counters: the same initial state before each input."""
        self.streams.synchronize()
        for lru in self.lru:
            lru.reset()
        self.streams.reset_stats()
        self.counters = {"hits": 0, "misses": 0, "evictions": 0}

    def lookup(self, layer: int, expert: int) -> bool:
        hit = self.lru[layer].lookup(expert)
        self.counters["hits" if hit else "misses"] += 1
        return hit

    def resident(self, layer: int, expert: int) -> Buffer:
        return self.slots[layer][self.lru[layer].slot_of[expert]]

    def swap_in(self, layer: int, expert: int) -> Buffer:
        """Load a missing expert through a staging buffer (on the compute stream); its buffer."""
        slot, evicted = self.lru[layer].admit(expert)
        self.counters["evictions"] += evicted is not None
        buffer = self.staging.popleft()
        self.streams.copy_in_order(buffer.data, self.store.expert(layer, expert))
        self.staging.append(self.slots[layer][slot])
        self.slots[layer][slot] = buffer
        return buffer

    def done(self, layer: int, expert: int) -> None:
        """The kernels reading `expert` are enqueued: it may be evicted again (its next copy queues behind them)."""
        self.lru[layer].done(expert)


class SwapExecutor:
    """Target executor of every HybridExperts layer: its routed experts through the swap cache, on demand.

    Per layer the router's experts are looked up (all marked used); up to `window` misses are swapped in,
    resident experts run first, and each consumed miss lets the next one in. Nothing is loaded before the
    router has decided (no prefetch), and every load is waited for (synchronous, on demand). A decode
    step's routing (one token, k distinct experts) is read once on the host and its expert outputs stacked
    in slot order; more tokens are grouped by expert (`group_by_expert`).
    """

    def __init__(self, cache: SwapCache, window: int) -> None:
        self.cache, self.window = cache, window

    def __call__(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        routed = top_k_index[0].tolist() if hidden.shape[0] == 1 else []  # a decode step's k experts
        if routed and len(set(routed)) == len(routed):
            rows = self._decode_step(module, hidden, routed)
        else:
            rows = self._grouped(module, hidden, top_k_index)
        return combine_rows(rows, top_k_weights, hidden.dtype)

    def _decode_step(self, module, hidden: torch.Tensor, routed: list[int]) -> torch.Tensor:
        """One token's rows [k, H] in slot order: each routed expert on `hidden` [1, H] as it is, in ascending
        order (as `group_by_expert` and the original's unique() order them)."""
        experts, outs = sorted(routed), {}

        def run(i: int, buffer: Buffer) -> None:
            outs[experts[i]] = expert_mlp(hidden, buffer.gate_up, buffer.down, module.act_fn)  # [1, H]

        self._run(module.moe_layer, experts, run)
        return torch.cat([outs[e] for e in routed])

    def _grouped(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """Rows [T*k, H] of several tokens: each expert on its tokens, gathered (`group_by_expert`)."""
        groups = group_by_expert(top_k_index, module.num_experts)
        rows = hidden.new_zeros(top_k_index.numel(), hidden.shape[-1])

        def run(i: int, buffer: Buffer) -> None:
            x = hidden[groups.token_idx[i]]  # [n_e, H]
            rows[groups.weight_idx[i]] = expert_mlp(x, buffer.gate_up, buffer.down, module.act_fn).to(rows.dtype)

        self._run(module.moe_layer, groups.experts, run)
        return rows

    def _run(self, layer: int, experts: list[int], run) -> None:
        """`run(i, buffer)` for each expert of `experts` (distinct): resident ones first, then the misses as
        their swaps come in."""
        cache = self.cache
        hits = [cache.lookup(layer, e) for e in experts]
        order = [i for i, hit in enumerate(hits) if hit] + [i for i, hit in enumerate(hits) if not hit]
        pending, loading = deque(i for i in order if not hits[i]), deque()
        self._issue(layer, experts, pending, loading)
        for i in order:
            run(i, cache.resident(layer, experts[i]) if hits[i] else loading.popleft())
            cache.done(layer, experts[i])
            self._issue(layer, experts, pending, loading)

    def _issue(self, layer: int, experts: list[int], pending: deque, loading: deque) -> None:
        while pending and len(loading) < self.window and self.cache.lru[layer].can_admit():
            loading.append(self.cache.swap_in(layer, experts[pending.popleft()]))


class MixtralOffloading:
    """Autoregressive greedy decoding (no speculation) whose routed experts come through a `SwapCache`.

    Reimplemented after dvmazur/mixtral-offloading (expert_cache.py): per-layer LRU eviction groups,
    swaps through `staging` device buffers, resident experts first. The FP weights come from the model's
    host store (a private copy if the experts are still on the device). The decode loop and metrics are
    target-only's; the model's own target executors are put back after every generate.
    """

    name = "mixtral_offloading"
    batch_mode = True

    def __init__(self, model: HybridMoEModel, slots: int, staging: int = STAGING_BUFFERS,
                 memory: str = "same cache") -> None:
        if not 1 <= slots <= model.num_experts:
            raise SpecterError(f"expert slots per layer must be in 1..{model.num_experts}, got {slots}")
        if staging < 2:
            raise SpecterError(f"staging buffers must be >= 2, got {staging}")
        self.model, self.slots, self.staging, self.memory = model, slots, staging, memory
        self.loop = TargetOnly(model)  # the same token-by-token loop, TPOT definition and KV handling
        self.cache: SwapCache | None = None

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (one step loads each expert once
        for every request that routes to it)."""
        if not is_batch(input_ids):
            input_ids = check_prompt(input_ids, max_new_tokens, self.model.vocab_size, self.model.max_positions)
        cache = self._swap_cache()
        cache.reset()
        result = self.loop.generate(input_ids, max_new_tokens, streams=cache.streams,
                                    executor=SwapExecutor(cache, self.staging - 1))
        results = result if isinstance(result, list) else [result]
        decode_tokens = sum(r.stats["generated_tokens"] - 1 for r in results)
        stats = self._stats(cache, results[0].stats["prefill_h2d_bytes"], decode_tokens)
        for r in results:
            r.stats.update(stats)
        return result

    def _swap_cache(self) -> SwapCache:
        """The cache over the model's host store (built once; again if the model's store appeared since)."""
        store = self.model.host_store
        if store is None and self.cache is not None:
            store = self.cache.store
        elif store is None:  # the experts are still on the device: a private copy
            store = move_experts_to_store(self.model, keep_on_device=True)
        if self.cache is None or self.cache.store is not store:
            self.cache = None  # free the old buffers first
            self.cache = SwapCache(store, self.slots, self.model.device, self.staging)
        return self.cache

    def _stats(self, cache: SwapCache, prefill_bytes: int, decode_tokens: int) -> dict:
        counters = dict(cache.counters)
        lookups = counters["hits"] + counters["misses"]
        stats = h2d_split({**counters, "hit_rate": counters["hits"] / lookups if lookups else float("nan"),
                           **cache.streams.stats()}, prefill_bytes, decode_tokens)
        stats.update(resident_experts_per_layer=self.slots, staging_buffers=self.staging, eviction_policy="lru",
                     expert_cache_bytes=cache.device_bytes, memory_policy=self.memory)
        return stats


def make_mo_sc(model: HybridMoEModel, specter_config: SpecterConfig) -> MixtralOffloading:
    """MO-SC: exactly Specter's FP slots per layer."""
    system = MixtralOffloading(model, specter_slots(model, specter_config), memory="same cache")
    system.name = "mo_sc"
    return system


def make_mo_sm(model: HybridMoEModel, specter_config: SpecterConfig) -> MixtralOffloading:
    """MO-SM: Specter's GPU memory, its INT4 draft bytes spent on extra FP slots."""
    plan = plan_memory(model.spec, model.hf.config, model.dtype)
    system = MixtralOffloading(model, same_memory_slots(specter_slots(model, specter_config), plan),
                               memory="same memory")
    system.name = "mo_sm"
    return system
