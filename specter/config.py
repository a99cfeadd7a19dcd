"""Frozen run-time configuration of the Specter engine (plain dataclasses, no Hydra)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specter.errors import SpecterError

EVICTION_POLICIES = ("lru", "lookahead", "popularity")
PREFETCH_VICTIMS = ("any", "stale")  # which resident experts a prefetch may evict


@dataclass(frozen=True)
class SpecterConfig:
    """How one engine decodes. The one owner of these defaults (the harness's conf/specter/default.yaml
    repeats them, checked by a test); every field is checked here, a bad value is a one-line SpecterError.

    k: speculation depth (draft tokens per iteration), >= 1.
    resident_experts_per_layer: FP16 expert-cache slots per MoE layer (None = all experts resident).
    temperature: 0 means greedy; > 0 samples with standard speculative (rejection) sampling.
    top_p: nucleus filter applied to both draft and target distributions when sampling.
    seed: seed of the sampling generator.
    prefetch: draft-time lookahead prefetch of FP experts (ablation: off = on-demand loading only).
    expert_wise: expert-wise verification (ablation: off = token-wise, chronological GEMVs).
    eviction: expert-cache victim policy, "lru" (the paper's), "lookahead" (never evicts an expert
      the current draft window predicts while another slot will do) or "popularity" (evicts the expert
      the target has routed the fewest tokens to in this request, LRU among ties).
    prefetch_victims: which resident experts a prefetch may evict: "any" (every one outside the window's
      plan and its draft's routing so far) or "stale" (only those the previous window's verification did
      not read either; a prefetch finding none is skipped and verification loads the expert into a
      released slot). Deep windows over few slots evict experts the same window then reloads: on
      calibrated qwen at K=24 with 15 slots, 3 in 4 prefetches did (scripts/sim_offload_bytes.py).
    initial_chunk: draft tokens of the Cold Start chunk (observed before the first prefetch).
    early_read_fraction: the Cold Start's last draft step reports the routing of its first
      ceil(fraction x MoE layers) layers as soon as it has computed them, and their prefetches start
      while it computes the rest (0: wait for the whole step; 1 is the same).
    prefetch_chunk: draft steps whose compute one prefetch batch's transfer may span (1: a batch per
      draft token, each issued as late as it can be).
    verify_wave: experts per verification wave (0: half the slots; -1: every slot of the layer); a smaller
      wave frees slots for copies sooner, a larger one launches fewer kernels (the host's cost per wave
      hardly depends on its size: results/reference/residual-h200/NOTES.md). With residual_transfer the blobs
      land in staging rows, not in the slots, so a wave of every slot holds no copy back.
    load_ahead_layers: how many next layers' planned loads start when a verify layer is done (into their
      slots that hold nothing they plan to use); 0 turns loads ahead off.
    copy_streams: 1, or 2 to put copies into slots still in use on their own stream, so copies into free
      slots never queue behind them (H2D bandwidth is shared; measured GB/s is then per stream).
    spare_rows: device rows for experts beyond the slots, shared by all layers (taken from the budget's
      workspace): a load lands in the spare released longest ago and its victim's row becomes a spare,
      so a copy never waits for the kernels still reading its victim (0: copies go into the victim's row).
    verify_spare_slots: a verify layer also streams through the spare rows, as slots of its own lent for the
      layer and given back (least recently used first, their experts evicted) when it ends: waves of half of
      slots + spare_rows, so fewer waves and decode launches per layer in the same memory. Loads into the
      layer's own slots then go into their victims' rows while the spares are lent; with residual_transfer
      that costs nothing, since the blobs cross into staging rows and only the decode waits for the row.
    verify_pooled_slots: N of each MoE layer's resident slots join the spare rows instead, lent to the verify
      layers as with verify_spare_slots (which N > 0 implies). In the same memory, each layer keeps
      resident_experts_per_layer - N slots and spare_rows + N x layers are shared, so the layer being verified
      streams through many more rows: fewer, wider waves and decode groups per layer, for a few more loads
      (each layer caches fewer experts between windows). With N >= resident_experts_per_layer the system
      reports itself unavailable (each layer keeps a slot of its own).
    cuda_graph: on CUDA with greedy decoding, replay the draft step as a CUDA graph over a static KV
      cache (eager decoding if capture fails; the reason is in the stats as draft_graph).
    draft_compile: torch.compile the draft step before capturing it (fused kernels for the dense part of
      each layer; compiling takes tens of seconds at the first request of each static cache shape, and a
      failure falls back to the plain step: draft_graph then says "on, not compiled: why").
    draft_ahead: during each verify pass the draft drafts the next window on a side stream over a KV cache
      of its own, from its guess of the bonus token; the next window takes those drafts when the target
      accepted the whole window with that bonus token (greedy, single requests; specter.offload.draft_ahead).
    draft_ahead_branch: with draft_ahead, also draft during each verify pass the window that follows the
      window's likeliest rejection (the draft position with the smallest margin between its top two tokens,
      corrected to the runner-up), on draft-ahead's side stream after its steps; the next window takes those
      drafts when the target rejects there with that token (specter.offload.draft_branch).
    draft_ahead_prompt: with draft_ahead, the first window is drafted from the prompt on the side stream while
      the target's prefill runs (the draft's own KV rows of the prompt, its guess of the first token, k steps
      after it); the first window takes those drafts when the guess is the target's first token.
    draft_ahead_in_flight: draft-ahead's captured steps (and its branch's) unfinished on their side stream at
      most, more queued after each verify layer; 0: every step queued when the verify pass starts
      (specter.offload.side_steps; docs/design.md has what each costs).
      Offloaded engines only (the ticks are the residency manager's layers).
    draft_decode_pairs: routed (token, slot) pairs of a draft call up to which its INT4 experts run through
      the GEMV decode kernel (specter.kernels.int4_decode; a draft step routes k pairs per request), the
      tiled fused kernel beyond; 0: always the tiled kernel (the ablation). CUDA only.
    residual_transfer: expert loads move the lossless residual of each 16-bit expert against the draft's
      INT4 codes already on the GPU (about 0.55x of the bytes in bf16, 0.7x in fp16) and a GPU kernel
      rebuilds the exact weights into the slot (specter.offload.residual_store).
    host_experts: during verification, planned experts that are not resident and that the draft routed few
      tokens to run on the CPU from the host store's weights (their hidden rows cross PCIe instead of the
      expert) in a worker thread, while the copy stream brings the others (specter.verify.host_experts).
    copy_issue: how the host issues each expert copy: "torch" (tensor.copy_) or "cudart" (one
      cudaMemcpyAsync call through ctypes, without torch's dispatch and stream switch: less host time per
      load; specter.offload.cudart).
    host_expert_threads: torch's intra-op threads in that worker thread (0: torch's count, which is every
      core; fewer leave cores to the main thread, which issues the GPU work, and to the CUDA driver).
    residual_decode_programs: grid cap of each residual decode launch (0: a program per tile of the expert);
      a small grid leaves the other SMs to the compute stream while the decode runs beside it.
    residual_decode_group: residual loads of one layer decoded by one launch (1: a launch per load): fewer
      launches and events on the host, while a group's first expert waits for its last blob (8: the fastest of
      1, 4 and 8 on calibrated dsv2 at mem=low on the H200, results/reference/residual-h200/NOTES.md).
    residual_group_copies: a decode group's blob copies are issued together when its decode launches (one
      wait and one pair of timing events per group instead of per load: less host time per residual load,
      while a group's first copy starts only once the group is full or needed).
    max_cache_len: positions of that static KV cache at least (grown when a request needs more; a request
      of the paper's protocol, 16 + 128 tokens, fits 256). Attention covers every position of it each
      step, and DeepSeek-V2 re-expands its MLA latent over all of them, so it is kept short.
    """

    k: int = 4
    resident_experts_per_layer: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    prefetch: bool = True
    expert_wise: bool = True
    eviction: str = "lru"
    prefetch_victims: str = "any"
    initial_chunk: int = 1
    early_read_fraction: float = 0.15
    prefetch_chunk: int = 1
    verify_wave: int = 0
    load_ahead_layers: int = 2
    copy_streams: int = 1
    spare_rows: int = 4
    verify_spare_slots: bool = False
    verify_pooled_slots: int = 0
    cuda_graph: bool = True
    draft_compile: bool = False
    draft_ahead: bool = False
    draft_ahead_branch: bool = False
    draft_ahead_prompt: bool = True
    draft_ahead_in_flight: int = 0
    draft_decode_pairs: int = 48
    residual_transfer: bool = False
    host_experts: bool = False
    host_expert_threads: int = 0
    copy_issue: str = "torch"
    residual_decode_programs: int = 0
    residual_decode_group: int = 8
    residual_group_copies: bool = False
    max_cache_len: int = 256

    def __post_init__(self) -> None:
        _integer(self, "k", 1, "speculation depth k")
        if self.resident_experts_per_layer is not None:
            _integer(self, "resident_experts_per_layer", 1, suffix=" or None")
        _number(self, "temperature", "a finite number >= 0", lambda x: x >= 0)
        _number(self, "top_p", "a number in (0, 1]", lambda x: 0.0 < x <= 1.0)
        _integer(self, "seed", None)
        for name in ("prefetch", "expert_wise", "cuda_graph", "draft_compile", "draft_ahead", "draft_ahead_branch",
                     "draft_ahead_prompt", "residual_transfer", "host_experts", "residual_group_copies",
                     "verify_spare_slots"):
            if not isinstance(getattr(self, name), bool):
                raise SpecterError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.eviction, str) or self.eviction not in EVICTION_POLICIES:
            raise SpecterError(f"eviction must be 'lru', 'lookahead' or 'popularity', got {self.eviction!r}")
        if self.prefetch_victims not in PREFETCH_VICTIMS:
            raise SpecterError(f"prefetch_victims must be 'any' or 'stale', got {self.prefetch_victims!r}")
        _integer(self, "initial_chunk", 1)
        _number(self, "early_read_fraction", "a number in [0, 1]", lambda x: 0.0 <= x <= 1.0)
        _integer(self, "prefetch_chunk", 1)
        _integer(self, "verify_wave", -1)
        _integer(self, "load_ahead_layers", 0)
        if type(self.copy_streams) is not int or self.copy_streams not in (1, 2):
            raise SpecterError(f"copy_streams must be 1 or 2, got {self.copy_streams!r}")
        _integer(self, "spare_rows", 0)
        _integer(self, "verify_pooled_slots", 0)
        _integer(self, "draft_decode_pairs", 0)
        _integer(self, "draft_ahead_in_flight", 0)
        _integer(self, "residual_decode_programs", 0)
        _integer(self, "residual_decode_group", 1)
        _integer(self, "host_expert_threads", 0)
        if self.copy_issue not in ("torch", "cudart"):
            raise SpecterError(f"copy_issue must be 'torch' or 'cudart', got {self.copy_issue!r}")
        _integer(self, "max_cache_len", 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against(self, num_experts: int) -> None:
        """Raise if the residency asks for more slots than the model has experts per layer."""
        slots = self.resident_experts_per_layer
        if slots is not None and slots > num_experts:
            raise SpecterError(
                f"resident_experts_per_layer={slots} exceeds the model's {num_experts} routed experts per layer"
            )


def _integer(config: SpecterConfig, name: str, least: int | None, what: str | None = None, suffix: str = "") -> None:
    """Raise unless config.<name> is an int (not a bool) >= least (any int when least is None)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        bound = "" if least is None else f" >= {least}"
        raise SpecterError(f"{what or name} must be an integer{bound}{suffix}, got {value!r}")


def _number(config: SpecterConfig, name: str, what: str, ok) -> None:
    """Raise unless config.<name> is a finite int or float (not a bool) for which ok() holds; store it as a float."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise SpecterError(f"{name} must be {what}, got {value!r}")
    object.__setattr__(config, name, float(value))  # 1 from a config file is 1.0
