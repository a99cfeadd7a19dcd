"""Attach the offload runtime to a hybrid model: FP experts to the host store, a slot cache, residency managers."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specter.config import SpecterConfig
from specter.defaults import config_default
from specter.errors import SpecterError
from specter.hooks import attributes_set
from specter.kernels.moe_align import MoEWorkspace
from specter.offload.cudart import copy_issuer
from specter.offload.eviction import RoutingCounts, make_policy
from specter.offload.expert_cache import ExpertCache
from specter.offload.host_store import HostExpertStore
from specter.offload.residual_store import ResidualExpertStore
from specter.offload.streams import DeviceStreams
from specter.verify.host_experts import HostCost, HostExpertRunner
from specter.verify.residency import ResidencyManager, VerifyOptions


@dataclass(frozen=True)
class OffloadConfig:
    """The slot cache one system decodes through and how it verifies (the defaults are SpecterConfig's).
    Systems sharing a model share its cache while their slots, policy and spare rows agree."""

    slots: int
    policy: str = config_default("eviction")
    spare_rows: int = config_default("spare_rows")
    prefetch_victims: str = config_default("prefetch_victims")
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    residual: bool = config_default("residual_transfer")
    decode_programs: int = config_default("residual_decode_programs")
    decode_group: int = config_default("residual_decode_group")
    copy_issue: str = config_default("copy_issue")  # how copies are issued (not part of the cache)
    group_copies: bool = config_default("residual_group_copies")  # a decode group's copies issued together
    spare_slots: bool = config_default("verify_spare_slots")  # verify layers stream through the spare rows too
    pooled_slots: int = config_default("verify_pooled_slots")  # of `slots`, per layer, moved to the spare rows

    @classmethod
    def of(cls, config: SpecterConfig) -> OffloadConfig:
        verify = VerifyOptions(config.expert_wise, config.verify_wave, config.load_ahead_layers, config.copy_streams,
                               config.host_experts, config.host_expert_threads)
        return cls(config.resident_experts_per_layer, config.eviction, config.spare_rows, config.prefetch_victims, verify,
                   config.residual_transfer, config.residual_decode_programs, config.residual_decode_group,
                   config.copy_issue, config.residual_group_copies, config.verify_spare_slots,
                   config.verify_pooled_slots)

    def pooled_problem(self) -> str:
        """Why `pooled_slots` cannot be met ("" when it can): each layer keeps at least one slot of its own."""
        if self.pooled_slots < self.slots:
            return ""
        return (f"verify_pooled_slots={self.pooled_slots} leaves no slot of its own per layer at {self.slots} "
                "resident experts per layer")

    def attach(self, model) -> OffloadRuntime:
        """The model's runtime with this cache (`offload_experts`: the experts move to the host store once):
        `slots - pooled_slots` slots per layer and `pooled_slots` rows of each layer added to the spare rows,
        lent to the verify layers (pooled slots imply spare slots)."""
        spare_rows = self.spare_rows + self.pooled_slots * len(model.experts)
        return offload_experts(model, self.slots - self.pooled_slots, self.policy, spare_rows, self.residual,
                               self.decode_programs, self.decode_group, self.prefetch_victims,
                               self.spare_slots or self.pooled_slots > 0)


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
    host_runner: HostExpertRunner | None = None  # made by the first `host_experts` call (kept)

    def host_experts(self, act, cost: HostCost | None = None, threads: int = 0) -> HostExpertRunner:
        """The worker that runs experts on the host with `threads` torch threads (0: torch's count), made on
        first use (again when `threads` differs) with `cost` or, by default, a cost its thread measures then
        (`act`: the experts' activation)."""
        if self.host_runner is not None and self.host_runner.threads != threads:
            self.host_runner.close()
            self.host_runner = None
        if self.host_runner is None:
            self.host_runner = HostExpertRunner(self.store, cost, act, threads)
        return self.host_runner


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


def offload_experts(model, slots: int, policy: str = config_default("eviction"),
                    spare_rows: int = config_default("spare_rows"),
                    residual: bool = config_default("residual_transfer"),
                    decode_programs: int = config_default("residual_decode_programs"),
                    decode_group: int = config_default("residual_decode_group"),
                    prefetch_victims: str = config_default("prefetch_victims"),
                    spare_slots: bool = config_default("verify_spare_slots")) -> OffloadRuntime:
    """Serve the target's experts from host memory with `slots` FP slots per layer (idempotent).

    The first call moves the FP experts into the host store (one way). A later call with another
    slot count, policy, number of spare rows or transfer format builds a new cache over the same store
    (the old one is freed first). With `residual`, loads move residual blobs (the residual store is built
    on first use and kept), decoded by launches of at most `decode_programs` programs (0: no cap), each
    for up to `decode_group` consecutive loads of one layer. `prefetch_victims`, `spare_slots`
    (verify_spare_slots): SpecterConfig's.
    The runtime's own residency manager (default verification options) becomes every layer's target
    executor.
    """
    if not 1 <= slots <= model.num_experts:
        raise SpecterError(f"resident experts per layer must be in 1..{model.num_experts}, got {slots}")
    runtime = model.offload
    cache = None if runtime is None else runtime.cache
    key = (slots, policy, spare_rows, residual, (decode_programs, decode_group) if residual else None, prefetch_victims,
           spare_slots)
    if cache is not None and cache.key == key:
        return runtime
    if model.host_store is None:
        model.host_store = move_experts_to_store(model)
    residuals = None if runtime is None else runtime.residuals
    if residual and residuals is None:
        residuals = ResidualExpertStore.build(model.host_store, model.experts)
    if runtime is None:
        streams = DeviceStreams(model.device)
    else:
        streams = runtime.streams
        runtime.cache.free()  # free the old slots before allocating the new ones
        release_device_memory()
    routing = RoutingCounts()
    cache = ExpertCache(model.host_store, slots, model.device, streams, make_policy(policy, routing), spare_rows,
                        residuals if residual else None, decode_programs, decode_group, prefetch_victims, spare_slots)
    residency = ResidencyManager(cache, routing, VerifyOptions(), MoEWorkspace())
    host_runner = None if runtime is None else runtime.host_runner
    runtime = OffloadRuntime(model.host_store, streams, cache, routing, residency, residuals, host_runner)
    for module in model.experts:
        module.target_executor = residency
    model.offload = runtime
    return runtime


@contextmanager
def serving(model, config: OffloadConfig, workspace: MoEWorkspace) -> Iterator[OffloadSession]:
    """For the duration of one call: the model's runtime with `config`'s cache (rebuilt if another system
    left another one), a residency manager with `config.verify` and `workspace` as every layer's target
    executor, the copy streams split as `config.verify.copy_streams` asks and copies issued as
    `config.copy_issue` says (a decode group's together with `config.group_copies`); the model's previous
    executors and stream settings afterwards."""
    runtime = config.attach(model)
    host = runtime.host_experts(model.experts[0].act_fn, threads=config.verify.host_threads) \
        if config.verify.host_experts else None
    residency = ResidencyManager(runtime.cache, runtime.routing, config.verify, workspace, host)
    with attributes_set(model.experts, target_executor=residency), \
            attributes_set([runtime.streams], split_waiting_copies=config.verify.copy_streams == 2,
                           h2d=copy_issuer(config.copy_issue), group_copies=config.group_copies):
        yield OffloadSession(runtime, residency)


def release_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
