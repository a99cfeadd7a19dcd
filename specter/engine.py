"""SpecterEngine.generate: the speculative decode loop (draft K with INT4 experts, verify once, commit)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from specter.batch.engine import generate_batch
from specter.config import SpecterConfig
from specter.inputs import check_batch, check_prompt, is_batch
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import DRAFT, TARGET
from specter.offload.draft_graph import capture_draft_step
from specter.offload.runtime import VerifyOptions, offload_experts
from specter.offload.trace_overlap import copy_idle_by_phase
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import NoPrefetch, PrefetchPlanner, early_read_layer
from specter.prefetch.quality import PrefetchQuality
from specter.spec.sampling import greedy_accept, logits_to_probs, next_token, rejection_accept, seeded_generator
from specter.spec.state import StateManager, new_static_cache


class SpecterEngine:
    """Speculative decoding on one shared-instance hybrid model.

    Each iteration: the draft (INT4 experts) proposes k = min(K, remaining - 1) tokens from the
    committed prefix while its routing is counted and turned into prefetches of FP experts; the
    target verifies them in one forward over k + 1 positions (expert-wise, cache hits first); the
    state manager commits the accepted prefix plus the correction or bonus token.
    Greedy output equals the target's greedy output; sampling preserves the target distribution.
    """

    name = "specter"
    batch_mode = True  # generate() also takes a list of prompts

    def __init__(self, model: HybridMoEModel, config: SpecterConfig | None = None) -> None:
        self.model = model
        self.config = config or SpecterConfig(k=model.spec.default_k)
        self.config.check_against(model.num_experts)
        self.generator: torch.Generator | None = None
        self.runtime = self._attach_offload()
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        if self.runtime is not None and self.config.prefetch:
            self.planner = PrefetchPlanner(PatternAnalyzer(self.elb), self.runtime.cache,
                                           initial_chunk=self.config.initial_chunk,
                                           prefetch_chunk=self.config.prefetch_chunk)
            self._tap_early_layers()
        else:
            self.planner = NoPrefetch()
        self.static_cache, self.draft_graph, self.graph_status = None, None, "off"
        self.batch_cache, self.batch_cache_key, self.batch_graph, self.batch_graph_status = None, None, None, "off"

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32,
                 eos_token_id: int | None = None) -> GenerationResult:
        """New tokens for a [1, T] prompt; stops early only at `eos_token_id` if one is given.

        A batch (a list of prompts: token lists or tensors, any lengths) gives a list of results, one per
        request, decoded together (greedy; `specter.batch`)."""
        if is_batch(input_ids):
            return generate_batch(self, check_batch(input_ids, max_new_tokens), max_new_tokens,
                                  eos_token_id)
        input_ids = check_prompt(input_ids, max_new_tokens)
        self._reset()
        metrics, quality = DecodeMetrics(self.model.device), PrefetchQuality()
        state = StateManager(self.model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        first = int(next_token(state.prefill(), self.config, self.generator)[0])
        self._capture_draft_graph(state)
        state.commit([first], kv_keep=state.kv_length)
        metrics.commit(1)
        self._end_prefill()
        while len(state.generated) < max_new_tokens and not _ended(state.generated, eos_token_id):
            k = state.window(min(self.config.k, max_new_tokens - len(state.generated) - 1))
            new_tokens, accepted = self.speculate(state, k, metrics)
            state.commit(new_tokens, kv_keep=state.kv_length + state.uncached_length + accepted)
            metrics.commit(len(new_tokens))
            metrics.window(k, accepted)
            self._close_window(k, quality)
        tokens = _cut_at_eos(state.generated[:max_new_tokens], eos_token_id)
        return GenerationResult(tokens, self._stats(metrics, quality))

    def speculate(self, state: StateManager, k: int, metrics: DecodeMetrics) -> tuple[list[int], int]:
        """One iteration: draft k tokens, verify k + 1 positions; returns (tokens to commit, n accepted)."""
        self._snapshot_residency()
        metrics.begin("draft")
        drafts, draft_probs = self.draft(state, k)
        metrics.end("draft")
        metrics.begin("verify")
        verify_input = torch.cat([state.uncached(), drafts.view(1, -1)], dim=1)  # [1, u+k], u = 1 but at a rope switch
        target_logits = self.model.forward(verify_input, state.cache, TARGET)[0, -(k + 1):]  # [k+1, V]
        if self.config.greedy:
            accepted, new_tokens = greedy_accept(drafts, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, self.config.temperature, self.config.top_p)
            accepted, new_tokens = rejection_accept(drafts, draft_probs, target_probs, self.generator)
        metrics.end("verify")
        return new_tokens, accepted

    def draft(self, state: StateManager, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens [k] (and their distributions [k, V] when sampling); tokens stay on the device.

        The draft router's choices go into the lookahead counters; the planner turns them into
        prefetches at chunk boundaries.
        """
        tokens, probs = [], []
        x = state.uncached()
        observing = self.model.observe_draft_routing(self.elb.observe) if k else nullcontext()
        with state.draft_scratch(), observing:
            self.planner.begin_window(k)
            for i in range(k):
                if self.draft_graph is not None:
                    token, p = self.draft_graph.step(x), None
                else:
                    token, p = next_token(self.model.forward(x, state.cache, DRAFT)[0, -1], self.config, self.generator)
                tokens.append(token)
                probs.append(p)
                x = token.view(1, 1)
                self.planner.after_draft_token(i + 1)
            if k:
                self.planner.end_window()
        empty = torch.empty(0, dtype=torch.long, device=self.model.device)
        drafted = torch.cat(tokens) if tokens else empty
        return drafted, (torch.stack(probs) if probs and probs[0] is not None else None)

    def _tap_early_layers(self) -> None:
        """Let the planner read the first draft step's early layers mid-step (config.early_read_fraction)."""
        layer = early_read_layer(self.config.early_read_fraction, self.model.num_moe_layers)
        tap = None if layer is None else self.runtime.streams.tap((layer + 1, self.model.num_experts), torch.int32)
        if tap is not None:
            self.elb.set_tap(layer, tap)

    def _static_cache(self, length: int):
        """The engine's static KV cache when the draft step runs as a CUDA graph (else None: dynamic KV)."""
        use = self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"
        if not use:
            return None
        needed = length + self.config.k + 2
        if self.static_cache is None or self.static_cache.max_cache_len < needed:
            self.static_cache = new_static_cache(self.model, max(needed, self.config.max_cache_len))
            self.draft_graph, self.graph_status = None, "off"  # captured addresses changed
        return self.static_cache

    def _capture_draft_graph(self, state: StateManager) -> None:
        """Capture the draft step once (after the first prefill has laid out the static cache)."""
        if state.cache is self.static_cache and self.draft_graph is None and self.graph_status == "off":
            self.draft_graph, reason = capture_draft_step(self.model, state.cache, self.elb, state.kv_length)
            self.graph_status = "on" if self.draft_graph is not None else f"failed: {reason}"

    def _attach_offload(self):
        slots = self.config.resident_experts_per_layer
        if slots is None:
            return None
        cfg = self.config
        options = VerifyOptions(cfg.expert_wise, cfg.verify_wave, cfg.load_ahead_layers, cfg.copy_streams,
                                cfg.spare_rows)
        return offload_experts(self.model, slots, cfg.eviction, options)

    def _reset(self) -> None:
        """Same starting state for every request: cache emptied, counters cleared, generator seeded."""
        if self.runtime is not None:
            self.runtime = self._attach_offload()  # another system may have switched the model's cache
            if isinstance(self.planner, PrefetchPlanner):
                self.planner.cache = self.runtime.cache
            self.runtime.reset()
        self.planner.reset()
        self.elb.clear()
        self._io_floor_bytes = self._prefill_h2d_bytes = 0
        self._window_sets: list[float] = []  # per verify window: distinct experts per layer (mean over layers)
        self.generator = seeded_generator(self.config, self.model.device)

    def _snapshot_residency(self) -> None:
        """Which experts were resident when this window started (for the I/O floor)."""
        if self.runtime is not None:
            cache = self.runtime.cache
            self._resident_at_start = [cache.resident_experts(layer) for layer in range(len(cache.layers))]
            cache.begin_window()

    def _count_io_floor(self, routed: dict) -> None:
        """Bytes the window could not avoid moving: routed experts that were not resident at its start."""
        if self.runtime is not None:
            missing = sum(len(experts - self._resident_at_start[layer]) for layer, experts in routed.items())
            self._io_floor_bytes += missing * self.runtime.store.expert_bytes

    def _close_window(self, k: int, quality: PrefetchQuality) -> None:
        """After a verify pass: the target's routing against the plan, the working set and the I/O floor."""
        routed = self._take_target_routing()
        if routed:
            self._window_sets.append(sum(len(s) for s in routed.values()) / len(routed))
        if k and self.planner.traces:  # a last pass with nothing drafted had no plan
            quality.add(self.planner.traces[-1].planned, routed)
        self._count_io_floor(routed)

    def _end_prefill(self) -> None:
        """The prefill's routing is not a verify window; its copies are counted apart from decoding's."""
        self._take_target_routing()
        self._prefill_h2d_bytes = self.runtime.streams.copied_bytes() if self.runtime is not None else 0

    def _take_target_routing(self) -> dict:
        return self.runtime.residency.take_demand() if self.runtime is not None else {}

    def _stats(self, metrics: DecodeMetrics, quality: PrefetchQuality) -> dict:
        stats = metrics.summary()
        stats["draft_graph"] = self.graph_status
        if self.runtime is not None:
            stats.update(self.runtime.stats())
            stats["h2d_bytes_per_token"] = stats["h2d_bytes"] / max(stats["generated_tokens"], 1)
            stats["prefill_h2d_bytes"] = self._prefill_h2d_bytes
            stats["decode_h2d_bytes"] = stats["h2d_bytes"] - self._prefill_h2d_bytes  # compare with io_floor_bytes
            stats.update(quality.stats())
            stats["prefetch_trace"] = [t.as_dict() for t in self.planner.traces]
            stats["io_floor_bytes"] = self._io_floor_bytes
            stats.update(copy_idle_by_phase(self.runtime.streams.copy_spans_ms(metrics.timeline),
                                            metrics.phase_spans_ms()))
            stats["window_working_sets"] = list(self._window_sets)
        return stats


def _ended(tokens: list[int], eos: int | None) -> bool:
    return eos is not None and eos in tokens


def _cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens
