"""SpecMoEOff's decode loop: separate INT4 draft and KV, fixed-position prefetch, token-wise verify, K by cost model."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from baselines.specmoeoff.draft_model import build_draft, draft_tensors
from baselines.specmoeoff.k_optimizer import CostModel, Window, best_k
from baselines.specmoeoff.microbatch import generate_microbatches
from baselines.specmoeoff.prefetch import FixedPositionPrefetch
from specter.config import MAX_CACHE_LEN
from specter.defaults import config_default
from specter.errors import SpecterError
from specter.inputs import check_batch, check_prompt, is_batch
from specter.kernels.moe_align import MoEWorkspace
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.draft.graph import DraftGraphCache
from specter.offload.runtime import OffloadConfig, serving
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import DEFAULT_H2D_BYTES_PER_MS, WindowPlan
from specter.speculative.sampling import next_token, seeded_generator
from specter.speculative.loop import decode_windows
from specter.speculative.state import StateManager
from specter.speculative.window import draft_window
from specter.verify.accept import verify_and_accept
from specter.verify.residency import VerifyOptions
from specter.window_accounting import WindowAccounting


@dataclass(frozen=True)
class SpecMoEOffConfig:
    """slots: FP slots per layer of the target's LRU cache. k_max: the optimizer's largest K (fixed_k: no
    optimizer). prefetch_at: draft steps after which the route-frequency prefetch runs. temperature, top_p,
    seed: sampling (0 = greedy). cuda_graph: on CUDA with greedy decoding, replay the draft step as a graph."""

    slots: int
    k_max: int = 32
    fixed_k: int | None = None
    prefetch_at: tuple[int, ...] = (1, 2)
    temperature: float = config_default("temperature")
    top_p: float = config_default("top_p")
    seed: int = config_default("seed")
    cuda_graph: bool = config_default("cuda_graph")

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch_at", tuple(int(p) for p in self.prefetch_at))
        if self.k_max < 1 or (self.fixed_k is not None and self.fixed_k < 1) or min(self.prefetch_at, default=0) < 1:
            raise SpecterError(f"SpecMoEOff needs k_max, fixed_k and prefetch positions >= 1, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpecMoEOff:
    """SpecMoEOff (Wang et al. 2025, arXiv 2508.21706), reimplemented from the Specter paper's description.

    Each iteration: K is chosen by the cost model; the separate INT4 draft extends its own KV cache by K
    tokens, its routing counted, and after fixed early draft steps the most frequent experts are prefetched
    into the target's LRU cache; the target verifies the K + 1 positions token-wise (one GEMV per token and
    expert, misses loaded on demand); both KV caches keep only the accepted prefix. Greedy output equals
    the target's greedy output.

    The windows of a single request (`OneRequest`) or of the microbatches (`microbatch.TakingTurns`) run in
    `specter.speculative.loop.decode_windows` on this system's `begin_window`, `verifying(plan)` and
    `close_window`, inside `serving`, after `begin_request` and `end_prefill`; `stats` at the end.
    """

    name = "specmoeoff"
    batch_mode = True  # two microbatches taking turns on the shared cache (microbatch.py)

    def __init__(self, model: HybridMoEModel, config: SpecMoEOffConfig) -> None:
        self.model, self.config = model, config
        self.draft_model = build_draft(model, MoEWorkspace())
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        self.graphs = DraftGraphCache(self.draft_model, self.elb)
        self.offload_config = OffloadConfig(config.slots, "lru", verify=VerifyOptions(expert_wise=False))  # token-wise
        self.verify_workspace = MoEWorkspace()
        runtime = self.offload_config.attach(model)
        self.prefetcher = FixedPositionPrefetch(PatternAnalyzer(self.elb), runtime.cache, config.prefetch_at)
        self.costs = CostModel(model.num_moe_layers, model.num_experts, model.top_k,
                               load_ms=runtime.store.expert_bytes / DEFAULT_H2D_BYTES_PER_MS)
        self.generator: torch.Generator | None = None
        self.session = None  # the OffloadSession of the running call
        self.accounting = WindowAccounting()
        self._k_trace: list[int] = []
        self._window_loads = 0

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (two microbatches, greedy)."""
        with self.serving():
            vocab = self.model.vocab_size
            if is_batch(input_ids):
                prompts = check_batch(input_ids, max_new_tokens, vocab, self.model.max_positions)
                return generate_microbatches(self, prompts, max_new_tokens)
            prompt = check_prompt(input_ids, max_new_tokens, vocab, self.model.max_positions)
            return self._generate_one(prompt, max_new_tokens)

    def _generate_one(self, input_ids: torch.Tensor, max_new_tokens: int) -> GenerationResult:
        self.begin_request()
        metrics = DecodeMetrics(self.model.device)
        target, draft = self.prefill(input_ids, max_new_tokens)
        metrics.commit(1)
        decode_windows(OneRequest(self, target, draft, metrics, max_new_tokens), self)
        return GenerationResult(target.generated[:max_new_tokens], self.stats(metrics))

    @contextmanager
    def serving(self) -> Iterator[None]:
        """The target's experts through the model's cache with this system's token-wise residency manager,
        for the duration of one call (offload.runtime.serving)."""
        with serving(self.model, self.offload_config, self.verify_workspace) as session:
            self.session = session
            try:
                yield
            finally:
                self.session = None

    def begin_request(self) -> None:
        """Same start for every request: cache emptied, counters cleared, generator seeded (costs carry over)."""
        self.session.reset()
        self.prefetcher.begin_request(self.session.cache)
        self.elb.clear()
        self.accounting = WindowAccounting(self.session)
        self._k_trace = []
        self.generator = seeded_generator(self.config, self.model.device)

    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[StateManager, StateManager]:
        """Target and draft each prefill the prompt into their own KV cache; the target's token is committed."""
        target = StateManager(self.model, input_ids)
        draft = StateManager(self.draft_model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        start = time.perf_counter()
        first = int(next_token(target.prefill(), self.config, self.generator)[0])
        self.costs.observe_verify(input_ids.shape[1], (time.perf_counter() - start) * 1e3, self._loads())
        draft.prefill()
        self.graphs.capture(None, draft.cache, draft.kv_length)
        self.end_prefill()
        for state in (target, draft):
            state.commit([first], kv_keep=state.kv_length)
        return target, draft

    def end_prefill(self) -> None:
        """The prefill's routing is not a verify window."""
        self.accounting.end_prefill()

    def begin_window(self) -> None:
        """Loads so far and the resident experts, before a window (for its load count and I/O floor)."""
        self._window_loads = self._loads()
        self.accounting.begin_window()

    def choose_k(self) -> int:
        return self.config.fixed_k or best_k(self.costs, self.config.k_max)

    def draft(self, state: StateManager, k: int) -> tuple[torch.Tensor, torch.Tensor | None, float | None,
                                                          WindowPlan | None]:
        """k draft tokens [k] (their distributions [k, V] when sampling), the measured ms per draft step and
        the window's plan (None when nothing is drafted).

        The first step feeds the draft's uncached committed tokens (1, or 2 after a fully accepted window).
        """
        start, step_ms = time.perf_counter(), []

        def step(i: int, previous) -> tuple[torch.Tensor, torch.Tensor | None]:
            x = state.uncached() if previous is None else previous[0].view(1, 1)  # [1, u]
            return self._draft_step(x, state.cache)

        def planned(drafted: int, read: bool) -> None:
            if read:  # the host has caught up with the draft
                step_ms.append((time.perf_counter() - start) * 1e3 / drafted)

        drafts, plan = draft_window(k, step, self.prefetcher,
                                    lambda: self.draft_model.observe_draft_routing(self.elb.observe), planned)
        if not drafts:
            return torch.empty(0, dtype=torch.long, device=self.model.device), None, None, plan
        tokens, probs = zip(*drafts)
        return (torch.cat(tokens), torch.stack(probs) if probs[0] is not None else None,
                step_ms[-1] if step_ms else None, plan)

    def verifying(self, plan: WindowPlan | None):
        """Context of the window's target pass: the residency manager verifies with `plan`."""
        return self.session.residency.verifying(plan)

    def close_window(self, plan: WindowPlan | None, window: Window) -> None:
        """After a window: the target's routing against the prefetch, the I/O floor, the cost model (a window
        with nothing drafted is not accounted)."""
        self._k_trace.append(window.k)
        if not window.k:
            self.accounting.skip_window()
            return
        self.accounting.close_window(plan)
        bandwidth = self.session.streams.measured_bandwidth()  # bytes per ms, None before any copy ended
        expert_bytes = self.session.store.expert_bytes
        self.costs.observe(window.k, window.accepted, window.ms, self._loads() - self._window_loads,
                           draft_ms=window.draft_ms, load_ms=expert_bytes / bandwidth if bandwidth else None)

    def stats(self, metrics: DecodeMetrics) -> dict:
        stats = self.accounting.stats(metrics, self.prefetcher.traces)
        stats["draft_graph"] = self.graphs.status(None)
        stats["k_per_window"] = list(self._k_trace)
        stats["cost_model"] = self.costs.as_dict()
        stats["draft_model_bytes"] = sum(t.numel() * t.element_size() for t in draft_tensors(self.draft_model))
        return stats

    def _draft_step(self, x: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's next token [1] after inputs x [1, u] (and its distribution [V] when sampling)."""
        graph = self.graphs.graph(None, cache)
        if graph is not None:
            for token in x[0]:  # one replay per input token
                out = graph.step(token)
            return out, None
        return next_token(self.draft_model.forward(x, cache)[0, -1], self.config, self.generator)  # logits [V]

    def _static_cache(self, length: int):
        """The draft's static KV cache when its step runs as a CUDA graph (else None: a dynamic cache)."""
        if not (self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"):
            return None
        return self.graphs.static_cache(None, length + self.config.k_max + 2, MAX_CACHE_LEN)

    def _loads(self) -> int:
        """Experts copied into the cache so far in this request (demand misses and prefetches)."""
        return self.session.cache.counters.loads


@dataclass
class OneRequest:
    """A single request after its prefill, as the window loop drives it: the target's and the separate draft's
    states, each keeping the KV of the accepted prefix."""

    system: SpecMoEOff
    target: StateManager
    draft_state: StateManager
    metrics: DecodeMetrics
    max_new_tokens: int

    def next_window(self) -> int | None:
        """k from the cost model (at most remaining - 1, within the rope's regime); None once done."""
        remaining = self.max_new_tokens - len(self.target.generated)
        return None if remaining <= 0 else self.target.window(min(self.system.choose_k(), remaining - 1))

    def draft(self, k: int) -> tuple[tuple, WindowPlan | None]:
        """(drafts [k], their distributions, ms per draft step, the window's start), the window's plan."""
        started = time.perf_counter()
        self.metrics.begin("draft")
        drafts, draft_probs, draft_ms, plan = self.system.draft(self.draft_state, k)
        self.metrics.end("draft")
        return (drafts, draft_probs, draft_ms, started), plan

    def verify(self, drafted: tuple) -> tuple:
        drafts, draft_probs, draft_ms, started = drafted
        system = self.system
        self.metrics.begin("verify")
        accepted, tokens = verify_and_accept(system.model, self.target, drafts, draft_probs, system.config,
                                             system.generator)
        self.metrics.end("verify")
        return accepted, tokens, draft_ms, started

    def commit(self, k: int, verified: tuple) -> Window:
        """Both states commit the tokens; the window as the cost model sees it."""
        accepted, tokens, draft_ms, started = verified
        target, draft = self.target, self.draft_state
        draft_keep = len(draft.tokens) + min(accepted, k - 1) if k else draft.kv_length  # its KV of accepted inputs
        target.commit(tokens, kv_keep=target.kv_length + target.uncached_length + accepted)
        draft.commit(tokens, kv_keep=draft_keep)
        self.metrics.commit(len(tokens))
        self.metrics.window(k, accepted)
        return Window(k, accepted, tokens, (time.perf_counter() - started) * 1e3, draft_ms)
