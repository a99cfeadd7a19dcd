"""Attach the offload runtime to a hybrid model: FP experts to the host store, a slot cache, the residency manager."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

import torch

from specter.errors import SpecterError
from specter.offload.expert_cache import ExpertCache
from specter.offload.host_store import HostExpertStore
from specter.offload.streams import DeviceStreams
from specter.verify.residency import ResidencyManager


@dataclass
class OffloadRuntime:
    """Everything that serves the target's routed experts from host memory through a fixed slot cache."""

    store: HostExpertStore
    streams: DeviceStreams
    cache: ExpertCache
    residency: ResidencyManager

    def reset(self) -> None:
        """Same initial state before each input: empty cache, zeroed counters."""
        self.streams.synchronize()
        self.cache.reset()
        self.residency.reset()
        self.streams.reset_stats()

    def stats(self) -> dict:
        counters = dict(self.cache.counters)
        lookups = counters["hits"] + counters["misses"]
        sets = self.residency.working_sets
        return {
            **counters,
            "hit_rate": counters["hits"] / lookups if lookups else float("nan"),
            **self.streams.stats(),
            "working_set_mean": mean(sets) if sets else float("nan"),
            "verify_host_ms": self.residency.host_ms,  # host time in the MoE layers of target passes
            "verify_host_wait_ms": self.residency.host_wait_ms,  # of it: waiting for routers' top-k
            "routing_counts": [self.residency.routing_counts.get(layer, []) for layer in range(len(self.cache.layers))],
            "resident_experts_per_layer": self.cache.slots_per_layer,
            "eviction_policy": self.cache.policy.name,
        }


def move_experts_to_store(model) -> HostExpertStore:
    """Copy every layer's FP experts into a new host store and drop them from the device, layer by layer."""
    first = model.experts[0]
    store = HostExpertStore(model.num_moe_layers, first.num_experts, first.hidden_dim, first.intermediate_dim,
                            first.gate_up_proj.dtype, model.device)
    for layer, module in enumerate(model.experts):
        store.put_layer(layer, module.gate_up_proj.detach(), module.down_proj.detach())
        del module.gate_up_proj, module.down_proj
    release_device_memory()
    return store


@dataclass(frozen=True)
class VerifyOptions:
    """How verification streams experts (SpecterConfig's verify_wave, load_ahead_layers, copy_streams,
    spare_rows; a change of spare_rows allocates a new cache)."""

    expert_wise: bool = True
    wave: int = 0
    ahead_layers: int = 2
    copy_streams: int = 1
    spare_rows: int = 4


def offload_experts(model, slots: int, policy: str = "lru", options: VerifyOptions | None = None) -> OffloadRuntime:
    """Serve the target's experts from host memory with `slots` FP slots per layer (idempotent).

    The first call moves the FP experts into the host store (one way). A later call with another
    slot count or policy builds a new cache over the same store. Every call sets the verification
    options (the defaults without `options`), so each system decodes with its own.
    """
    if not 1 <= slots <= model.num_experts:
        raise SpecterError(f"resident experts per layer must be in 1..{model.num_experts}, got {slots}")
    options = options or VerifyOptions()
    runtime = model.offload
    cache = None if runtime is None else runtime.cache
    if cache is not None and (cache.slots_per_layer, cache.policy.name, cache.spare_rows) == (
            slots, policy, options.spare_rows):
        _configure(runtime, options)
        return runtime
    if model.host_store is None:
        model.host_store = move_experts_to_store(model)
    store = model.host_store
    if runtime is None:
        streams = DeviceStreams(model.device)
    else:
        streams = runtime.streams
        runtime.cache.free()  # free the old slots before allocating the new ones
        release_device_memory()
    cache = ExpertCache(store, slots, model.device, streams, policy, options.spare_rows)
    runtime = OffloadRuntime(store, streams, cache, ResidencyManager(cache))
    _configure(runtime, options)
    for module in model.experts:
        module.target_executor = runtime.residency
    model.offload = runtime
    return runtime


def _configure(runtime: OffloadRuntime, options: VerifyOptions) -> None:
    residency = runtime.residency
    residency.expert_wise, residency.wave, residency.ahead_layers = (options.expert_wise, options.wave,
                                                                     options.ahead_layers)
    runtime.streams.split_waiting_copies = options.copy_streams == 2


def is_offloaded(model) -> bool:
    return getattr(model, "offload", None) is not None


def release_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
