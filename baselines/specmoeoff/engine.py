"""SpecMoEOff's decode loop: separate INT4 draft and KV, fixed-position prefetch, token-wise verify, K by cost model."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from baselines.specmoeoff.draft_model import build_draft, draft_tensors
from baselines.specmoeoff.k_optimizer import DEFAULT_H2D_BYTES_PER_MS, CostModel, best_k
from baselines.specmoeoff.microbatch import generate_microbatches
from baselines.specmoeoff.prefetch import FixedPositionPrefetch
from specter.errors import SpecterError
from specter.inputs import check_batch, check_prompt, is_batch
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import TARGET
from specter.offload.draft_graph import capture_draft_step
from specter.offload.runtime import VerifyOptions, offload_experts
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.quality import PrefetchQuality
from specter.spec.sampling import greedy_accept, logits_to_probs, next_token, rejection_accept, seeded_generator
from specter.spec.state import StateManager, new_static_cache

MIN_STATIC_CACHE = 256  # as SpecterConfig.max_cache_len: attention covers all of it every draft step


@dataclass(frozen=True)
class SpecMoEOffConfig:
    """slots: FP slots per layer of the target's LRU cache. k_max: the optimizer's largest K (fixed_k: no
    optimizer). prefetch_at: draft steps after which the route-frequency prefetch runs. temperature, top_p,
    seed: sampling (0 = greedy). cuda_graph: on CUDA with greedy decoding, replay the draft step as a graph."""

    slots: int
    k_max: int = 32
    fixed_k: int | None = None
    prefetch_at: tuple[int, ...] = (1, 2)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    cuda_graph: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch_at", tuple(int(p) for p in self.prefetch_at))
        if self.k_max < 1 or (self.fixed_k is not None and self.fixed_k < 1) or min(self.prefetch_at, default=0) < 1:
            raise SpecterError(f"SpecMoEOff needs k_max, fixed_k and prefetch positions >= 1, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Window:
    """One speculative iteration as measured: k drafted, n accepted, tokens committed, wall ms, draft ms/step."""

    k: int
    accepted: int
    tokens: list[int]
    ms: float
    draft_ms: float | None


class SpecMoEOff:
    """SpecMoEOff (Wang et al. 2025, arXiv 2508.21706), reimplemented from the Specter paper's description.

    Each iteration: K is chosen by the cost model; the separate INT4 draft extends its own KV cache by K
    tokens, its routing counted, and after fixed early draft steps the most frequent experts are prefetched
    into the target's LRU cache; the target verifies the K + 1 positions token-wise (one GEMV per token and
    expert, misses loaded on demand); both KV caches keep only the accepted prefix. Greedy output equals
    the target's greedy output.
    """

    name = "specmoeoff"
    batch_mode = True  # two microbatches taking turns on the shared cache (microbatch.py)

    def __init__(self, model: HybridMoEModel, config: SpecMoEOffConfig) -> None:
        self.model, self.config = model, config
        self.draft_model = build_draft(model)
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        self.runtime = self._attach()
        self.prefetcher = FixedPositionPrefetch(PatternAnalyzer(self.elb), self.runtime.cache, config.prefetch_at)
        self.costs = CostModel(model.num_moe_layers, model.num_experts, model.top_k,
                               load_ms=self.runtime.store.expert_bytes / DEFAULT_H2D_BYTES_PER_MS)
        self.generator: torch.Generator | None = None
        self.draft_cache, self.draft_graph, self.graph_status = None, None, "off"

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (two microbatches, greedy)."""
        if is_batch(input_ids):
            return generate_microbatches(self, check_batch(input_ids, max_new_tokens), max_new_tokens)
        input_ids = check_prompt(input_ids, max_new_tokens)
        self._reset()
        metrics, quality = DecodeMetrics(self.model.device), PrefetchQuality()
        target, draft = self.prefill(input_ids, max_new_tokens)
        metrics.commit(1)
        while len(target.generated) < max_new_tokens:
            k = target.window(min(self.choose_k(), max_new_tokens - len(target.generated) - 1))
            window = self.speculate(target, draft, k, metrics)
            metrics.commit(len(window.tokens))
            metrics.window(k, window.accepted)
            self._account(window, quality)
        return GenerationResult(target.generated[:max_new_tokens], self._stats(metrics, quality))

    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[StateManager, StateManager]:
        """Target and draft each prefill the prompt into their own KV cache; the target's token is committed."""
        target = StateManager(self.model, input_ids)
        draft = StateManager(self.draft_model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        start = time.perf_counter()
        first = int(next_token(target.prefill(), self.config, self.generator)[0])
        self.costs.observe_verify(input_ids.shape[1], (time.perf_counter() - start) * 1e3, self._loads())
        draft.prefill()
        self._capture_draft_graph(draft)
        self.runtime.residency.take_demand()  # the prefill's routing is not a verify window
        for state in (target, draft):
            state.commit([first], kv_keep=state.kv_length)
        return target, draft

    def begin_window(self) -> None:
        """Loads so far and the resident experts, before a window (for its load count and I/O floor)."""
        self._window_loads = self._loads()
        self._resident_at_start = [self.runtime.cache.resident_experts(j) for j in range(self.model.num_moe_layers)]

    def choose_k(self) -> int:
        return self.config.fixed_k or best_k(self.costs, self.config.k_max)

    def speculate(self, target: StateManager, draft: StateManager, k: int, metrics: DecodeMetrics) -> Window:
        """Draft k tokens on the draft's KV, verify k + 1 positions on the target's, commit to both."""
        start = time.perf_counter()
        self.begin_window()
        metrics.begin("draft")
        drafts, draft_probs, draft_ms = self.draft(draft, k)
        metrics.end("draft")
        metrics.begin("verify")
        accepted, tokens = self.verify(target, drafts, draft_probs)
        metrics.end("verify")
        draft_keep = len(draft.tokens) + min(accepted, k - 1) if k else draft.kv_length  # its KV of accepted inputs
        target.commit(tokens, kv_keep=target.kv_length + target.uncached_length + accepted)
        draft.commit(tokens, kv_keep=draft_keep)
        return Window(k, accepted, tokens, (time.perf_counter() - start) * 1e3, draft_ms)

    def draft(self, state: StateManager, k: int) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """k draft tokens [k] (their distributions [k, V] when sampling) and the measured ms per draft step.

        The first step feeds the draft's uncached committed tokens (1, or 2 after a fully accepted window).
        """
        tokens, probs, step_ms = [], [], None
        x, start = state.uncached(), time.perf_counter()  # [1, u]
        if k:
            with self.draft_model.observe_draft_routing(self.elb.observe):
                self.prefetcher.begin_window(k)
                for i in range(k):
                    token, p = self._draft_step(x, state.cache)
                    tokens.append(token)
                    probs.append(p)
                    x = token.view(1, 1)
                    if self.prefetcher.after_draft_token(i + 1):  # the host has caught up with the draft
                        step_ms = (time.perf_counter() - start) * 1e3 / (i + 1)
                self.prefetcher.end_window()
        drafted = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self.model.device)
        return drafted, (torch.stack(probs) if tokens and probs[0] is not None else None), step_ms

    def verify(self, target: StateManager, drafts: torch.Tensor, draft_probs) -> tuple[int, list[int]]:
        """Token-wise target pass over [uncached, d1..dk]; (n accepted, tokens to commit)."""
        verify_input = torch.cat([target.uncached(), drafts.view(1, -1)], dim=1)  # [1, u+k]
        logits = self.model.forward(verify_input, target.cache, TARGET)[0, -(len(drafts) + 1):]  # [k+1, V]
        if self.config.greedy:
            return greedy_accept(drafts, logits)
        target_probs = logits_to_probs(logits, self.config.temperature, self.config.top_p)
        return rejection_accept(drafts, draft_probs, target_probs, self.generator)

    def _draft_step(self, x: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's next token [1] after inputs x [1, u] (and its distribution [V] when sampling)."""
        if self.draft_graph is not None:
            for token in x[0]:  # one replay per input token
                out = self.draft_graph.step(token)
            return out, None
        return next_token(self.draft_model.forward(x, cache)[0, -1], self.config, self.generator)  # logits [V]


    def _attach(self):
        """The target's experts through Specter's host store and LRU cache, verified token-wise (no fused kernel)."""
        return offload_experts(self.model, self.config.slots, "lru", VerifyOptions(expert_wise=False))

    def _reset(self) -> None:
        """Same start for every request: cache emptied, counters cleared, generator seeded (costs carry over)."""
        self.runtime = self._attach()  # another system may have switched the model's cache
        self.prefetcher.cache = self.runtime.cache
        self.runtime.reset()
        self.prefetcher.reset()
        self.elb.clear()
        self._k_trace, self._window_sets, self._io_floor_bytes = [], [], 0
        self.generator = seeded_generator(self.config, self.model.device)

    def _static_cache(self, length: int):
        """The draft's static KV cache when its step runs as a CUDA graph (else None: a dynamic cache)."""
        if not (self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"):
            return None
        needed = length + self.config.k_max + 2
        if self.draft_cache is None or self.draft_cache.max_cache_len < needed:
            self.draft_cache = new_static_cache(self.draft_model, max(needed, MIN_STATIC_CACHE))
            self.draft_graph, self.graph_status = None, "off"  # captured addresses changed
        return self.draft_cache

    def _capture_draft_graph(self, draft: StateManager) -> None:
        if draft.cache is self.draft_cache and self.draft_graph is None and self.graph_status == "off":
            self.draft_graph, reason = capture_draft_step(self.draft_model, draft.cache, self.elb, draft.kv_length)
            self.graph_status = "on" if self.draft_graph is not None else f"failed: {reason}"

    def _loads(self) -> int:
        """Experts copied into the cache so far in this request (demand misses and prefetches)."""
        counters = self.runtime.cache.counters
        return counters["misses"] + counters["prefetch_loads"]

    def _account(self, window: Window, quality: PrefetchQuality) -> None:
        """After a window: the target's routing against the prefetch, the I/O floor, the cost model."""
        routed = self.runtime.residency.take_demand()  # layer -> experts the target routed to
        self._k_trace.append(window.k)
        if not window.k:
            return
        quality.add(self.prefetcher.traces[-1].planned, routed)
        self._window_sets.append(sum(len(s) for s in routed.values()) / max(len(routed), 1))
        missing = sum(len(experts - self._resident_at_start[layer]) for layer, experts in routed.items())
        self._io_floor_bytes += missing * self.runtime.store.expert_bytes
        bandwidth = self.runtime.streams.measured_bandwidth()  # bytes per ms, None before any copy ended
        self.costs.observe(window.k, window.accepted, window.ms, self._loads() - self._window_loads,
                           draft_ms=window.draft_ms,
                           load_ms=self.runtime.store.expert_bytes / bandwidth if bandwidth else None)

    def _stats(self, metrics: DecodeMetrics, quality: PrefetchQuality) -> dict:
        stats = metrics.summary()
        stats.update(self.runtime.stats())
        stats["h2d_bytes_per_token"] = stats["h2d_bytes"] / max(stats["generated_tokens"], 1)
        stats.update(quality.stats())
        stats["prefetch_trace"] = [t.as_dict() for t in self.prefetcher.traces]
        stats["io_floor_bytes"] = self._io_floor_bytes
        stats["window_working_sets"] = list(self._window_sets)
        stats["draft_graph"] = self.graph_status
        stats["k_per_window"] = list(self._k_trace)
        stats["cost_model"] = self.costs.as_dict()
        stats["draft_model_bytes"] = sum(t.numel() * t.element_size() for t in draft_tensors(self.draft_model))
        return stats
