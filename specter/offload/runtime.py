"""Attach the offload runtime to a hybrid model: FP experts to the host store, a slot cache, residency managers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.kernels.moe_align import MoEWorkspace
from specter.offload.coded_slots import CodedSlots, coded_rows
from specter.offload.eviction import RoutingCounts, make_policy
from specter.offload.expert_cache import ExpertCache
from specter.offload.host_store import HostExpertStore
from specter.offload.residual_store import ResidualExpertStore
from specter.offload.streams import DeviceStreams
from specter.verify.residency import ResidencyManager, VerifyOptions


SPARE_ROWS = 4  # device rows shared by all layers beyond the slots: a load never waits for its victim's readers
DECODE_GROUP = 8  # residual loads of one layer decoded by one launch (the fastest of 1, 4 and 8 measured)


@dataclass(frozen=True)
class OffloadConfig:
    """The slot cache one system decodes through and how it verifies. The defaults are the paper's design (raw
    copies, LRU, waves of half the slots), which the baselines share; Specter's engine sets its own.
    Systems sharing a model share its cache while their slots, policy, spare rows and transfer format agree."""

    slots_per_layer: int  # SpecterConfig.resident_experts_per_layer: FP expert slots per MoE layer
    eviction: str = "lru"
    spare_rows: int = SPARE_ROWS
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    residual: bool = False  # loads move residual blobs; a decode group's copies are issued together
    pooled_slots: int = 0  # of `slots`, per layer, moved to the spare rows and lent to the verify layers
    coded: bool = False  # the slots' memory holds residual blobs, rebuilt per verify wave (with `residual`)
    keep_raw: bool = True  # False (with `residual`): the host store lets each layer's raw experts go once encoded

    @classmethod
    def of(cls, config: SpecterConfig) -> OffloadConfig:
        """The cache of a (resolved) SpecterConfig: with pooled slots, waves of every slot a layer holds."""
        verify = VerifyOptions(config.expert_wise, -1 if config.pooled_slots else 0)
        return cls(config.resident_experts_per_layer, config.eviction, SPARE_ROWS, verify, config.residual_transfer,
                   config.pooled_slots, config.coded_slots)

    def attach(self, model) -> OffloadRuntime:
        """The model's runtime with this cache (`offload_experts`: the experts move to the host store once):
        `slots_per_layer - pooled_slots` slots per layer and `pooled_slots` rows of each layer added to the spare rows,
        lent to the verify layers; with `coded`, that memory holds residual blobs."""
        spare_rows = self.spare_rows + self.pooled_slots * len(model.experts)
        return offload_experts(model, self.slots_per_layer - self.pooled_slots, self.eviction, spare_rows,
                               self.residual, self.pooled_slots > 0, self.coded and self.residual, self.keep_raw)


@dataclass
class OffloadRuntime:
    """The model's offloaded experts: the host store, the copy streams, the slot cache, the target routing
    counts its eviction policy reads, and the residency manager that serves target forwards outside any
    system's call (systems install their own for the duration of a call: `serving`); `residuals`: the
    residual store once a cache with residual transfer has been asked for (built once, kept)."""

    store: HostExpertStore
    streams: DeviceStreams
    cache: ExpertCache
    routing: RoutingCounts
    residency: ResidencyManager
    residuals: ResidualExpertStore | None = None


@dataclass
class OffloadSession:
    """One system's use of the model's runtime during one generate() call, with its own residency manager."""

    runtime: OffloadRuntime
    residency: ResidencyManager

    @property
    def cache(self) -> ExpertCache:
        return self.runtime.cache

    @property
    def streams(self) -> DeviceStreams:
        return self.runtime.streams

    @property
    def store(self) -> HostExpertStore:
        return self.runtime.store

    def reset(self) -> None:
        """Same initial state before each input: empty cache, zeroed counters."""
        self.streams.synchronize()
        self.cache.reset()
        self.runtime.routing.clear()
        self.residency.reset()
        self.streams.reset_stats()

    def stats(self) -> dict:
        counters = self.cache.counters.as_dict()
        lookups = counters["hits"] + counters["misses"]
        return {
            **counters,
            "hit_rate": counters["hits"] / lookups if lookups else float("nan"),
            **self.streams.stats(),
            **self.residency.stats(),
            "routing_counts": self.runtime.routing.per_layer(len(self.cache.layers)),
            "resident_experts_per_layer": self.cache.slots_per_layer,
            "expert_load_bytes": self.cache.load_bytes,  # what one load moves (the mean blob with residuals)
            "eviction_policy": self.cache.policy.name,
        }


def move_experts_to_store(model, keep_on_device: bool = False) -> HostExpertStore:
    """A new host store holding every layer's FP experts, moved layer by layer (each layer's device copy
    dropped as it goes), or copied with `keep_on_device`."""
    store = HostExpertStore.for_experts(model.experts, model.experts[0].gate_up_proj.dtype, model.device)
    for layer, module in enumerate(model.experts):
        store.put_layer(layer, module.gate_up_proj.detach(), module.down_proj.detach())
        if not keep_on_device:
            del module.gate_up_proj, module.down_proj
    if not keep_on_device:
        release_device_memory()
    return store


def offload_experts(model, slots_per_layer: int, eviction: str = "lru", spare_rows: int = SPARE_ROWS,
                    residual: bool = False, pooled: bool = False, coded: bool = False,
                    keep_raw: bool = True) -> OffloadRuntime:
    """Serve the target's experts from host memory with `slots_per_layer` FP slots per layer (idempotent).

    The first call moves the FP experts into the host store (one way). A later call with another
    slot count, eviction policy, number of spare rows or transfer format builds a new cache over the same store
    (the old one is freed first). With `residual`, loads move residual blobs (the residual store is built
    on first use and kept), decoded `DECODE_GROUP` consecutive loads of one layer per launch. With
    `pooled` the verify layers also stream through the spare rows (lent for the layer). With `residual` and
    `coded`, the memory of those slots and spare rows, less `coded_slots.SCRATCH_ROWS` 16-bit rows, holds residual
    blobs (`coded_slots.coded_rows`: as many rows of the longest blob as fit), rebuilt per verify wave. Without
    `keep_raw` the residual store's build lets the host store's raw experts go layer by layer (only systems that
    read residual blobs can serve the model afterwards).
    The runtime's own residency manager (default verification options) becomes every layer's target
    executor.
    """
    if not 1 <= slots_per_layer <= model.num_experts:
        raise SpecterError(f"resident experts per layer must be in 1..{model.num_experts}, got {slots_per_layer}")
    runtime, coded = model.offload, coded and residual
    if model.host_store is None:
        model.host_store = move_experts_to_store(model)
    residuals = model.residual_store if runtime is None else runtime.residuals  # built once (at load, or here)
    if residual and residuals is None:
        residuals = ResidualExpertStore.build(model.host_store, model.experts, release_raw=not keep_raw)
    scratch = 0
    if coded:
        store = model.host_store
        slots_per_layer, spare_rows, scratch = coded_rows(slots_per_layer, spare_rows, store.num_layers,
                                                          store.num_experts, store.expert_bytes,
                                                          residuals.max_blob_words * 4)
    key = (slots_per_layer, eviction, spare_rows, residual, DECODE_GROUP if residual else None, pooled, scratch)
    if runtime is not None and runtime.cache.key == key:
        runtime.streams.group_copies = residual
        return runtime
    if runtime is None:
        streams = DeviceStreams(model.device)
    else:
        streams = runtime.streams
        runtime.cache.free()  # free the old slots before allocating the new ones
        release_device_memory()
    routing = RoutingCounts()
    store = model.host_store
    coded_memory = None if not coded else CodedSlots(residuals, store.num_layers * slots_per_layer + spare_rows,
                                                     scratch, store.numel, store.dtype, model.device)
    cache = ExpertCache(store, slots_per_layer, model.device, streams, make_policy(eviction, routing), spare_rows,
                        residuals if residual else None, DECODE_GROUP, pooled, coded_memory)
    residency = ResidencyManager(cache, routing, VerifyOptions(), MoEWorkspace())
    runtime = OffloadRuntime(model.host_store, streams, cache, routing, residency, residuals)
    for module in model.experts:
        module.target_executor = residency
    streams.group_copies = residual  # a decode group's residual copies are issued together
    model.offload = runtime
    return runtime


def offload_session(model, config: OffloadConfig, workspace: MoEWorkspace) -> OffloadSession:
    """One system's session for one call: the model's runtime with `config`'s cache (rebuilt if another system
    left another one) and a residency manager with `config.verify` and `workspace`, which the system passes to
    its target forwards (`session.residency`, or a window's `session.residency.window(plan)`)."""
    runtime = config.attach(model)
    return OffloadSession(runtime, ResidencyManager(runtime.cache, runtime.routing, config.verify, workspace))


def release_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
