"""SpecMoEOff's decode loop: separate INT4 draft and KV, fixed-position prefetch, token-wise verify, K by cost model."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from baselines.specmoeoff.draft_model import build_draft, draft_tensors
from baselines.specmoeoff.k_optimizer import CostModel, best_k
from baselines.specmoeoff.microbatch import generate_microbatches
from baselines.specmoeoff.prefetch import FixedPositionPrefetch
from baselines.specmoeoff.windows import OneRequest, SpecMoEOffCall
from specter.config import MAX_CACHE_LEN
from specter.defaults import config_default
from specter.errors import SpecterError
from specter.inputs import check_batch, check_prompt, is_batch
from specter.kernels.moe_align import MoEWorkspace
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.draft.graph import DraftGraphCache
from specter.offload.runtime import OffloadConfig, offload_session
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import DEFAULT_H2D_BYTES_PER_MS, WindowPlan
from specter.speculative.sampling import next_token, seeded_generator
from specter.speculative.loop import decode_windows
from specter.speculative.state import StateManager
from specter.speculative.window import draft_window
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

    `begin_request(session())` starts a call (`windows.SpecMoEOffCall`: session, accounting,
    generator, the K of each window), and the windows of a single request (`windows.OneRequest`) or of the
    microbatches (`microbatch.TakingTurns`) run in `specter.speculative.loop.decode_windows` on it; `stats(call,
    metrics)` at the end.
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

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (two microbatches, greedy)."""
        vocab, session = self.model.vocab_size, self.session()
        if is_batch(input_ids):
            prompts = check_batch(input_ids, max_new_tokens, vocab, self.model.max_positions)
            return generate_microbatches(self, session, prompts, max_new_tokens)
        prompt = check_prompt(input_ids, max_new_tokens, vocab, self.model.max_positions)
        return self._generate_one(session, prompt, max_new_tokens)

    def _generate_one(self, session, input_ids: torch.Tensor, max_new_tokens: int) -> GenerationResult:
        call = self.begin_request(session)
        metrics = DecodeMetrics(self.model.device)
        target, draft = self.prefill(call, input_ids, max_new_tokens)
        metrics.commit(1)
        decode_windows(OneRequest(self, call, target, draft, metrics, max_new_tokens), call)
        return GenerationResult(target.generated[:max_new_tokens], self.stats(call, metrics))

    def session(self):
        """The call's offload session: the model's cache with this system's token-wise residency manager
        (offload.runtime.offload_session)."""
        return offload_session(self.model, self.offload_config, self.verify_workspace)

    def begin_request(self, session) -> SpecMoEOffCall:
        """Same start for every request (cache emptied, counters cleared; the cost model carries over): the call's
        runtime over the offload `session`, its generator seeded."""
        session.reset()
        self.prefetcher.begin_request(session.cache)
        self.elb.clear()
        return SpecMoEOffCall(session, WindowAccounting(session), seeded_generator(self.config, self.model.device),
                              self.costs)

    def prefill(self, call: SpecMoEOffCall, input_ids: torch.Tensor,
                max_new_tokens: int) -> tuple[StateManager, StateManager]:
        """Target and draft each prefill the prompt into their own KV cache; the target's token is committed."""
        target = StateManager(self.model, input_ids)
        draft = StateManager(self.draft_model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        start = time.perf_counter()
        first = int(next_token(target.prefill(call.executor), self.config, call.generator)[0])
        self.costs.observe_verify(input_ids.shape[1], (time.perf_counter() - start) * 1e3, call.loads)
        draft.prefill()
        self.graphs.capture(None, draft.cache, draft.kv_length)
        call.end_prefill()
        for state in (target, draft):
            state.commit([first], kv_keep=state.kv_length)
        return target, draft

    def choose_k(self) -> int:
        return self.config.fixed_k or best_k(self.costs, self.config.k_max)

    def draft(self, state: StateManager, k: int, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, float | None, WindowPlan | None]:
        """k draft tokens [k] (their distributions [k, V] when sampling from `generator`), the measured ms per
        draft step and the window's plan (None when nothing is drafted).

        The first step feeds the draft's uncached committed tokens (1, or 2 after a fully accepted window).
        """
        start, step_ms = time.perf_counter(), []

        def step(i: int, previous) -> tuple[torch.Tensor, torch.Tensor | None]:
            x = state.uncached() if previous is None else previous[0].view(1, 1)  # [1, u]
            return self._draft_step(x, state.cache, generator)

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

    def stats(self, call: SpecMoEOffCall, metrics: DecodeMetrics) -> dict:
        stats = call.accounting.stats(metrics, self.prefetcher.traces)
        stats["draft_graph"] = self.graphs.status(None)
        stats["k_per_window"] = list(call.k_trace)
        stats["cost_model"] = self.costs.as_dict()
        stats["draft_model_bytes"] = sum(t.numel() * t.element_size() for t in draft_tensors(self.draft_model))
        return stats

    def _draft_step(self, x: torch.Tensor, cache, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's next token [1] after inputs x [1, u] (and its distribution [V] when sampling)."""
        graph = self.graphs.graph(None, cache)
        if graph is not None:
            for token in x[0]:  # one replay per input token
                out = graph.step(token)
            return out, None
        return next_token(self.draft_model.forward(x, cache)[0, -1], self.config, generator)  # logits [V]

    def _static_cache(self, length: int):
        """The draft's static KV cache when its step runs as a CUDA graph (else None: a dynamic cache)."""
        if not (self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"):
            return None
        return self.graphs.static_cache(None, length + self.config.k_max + 2, MAX_CACHE_LEN)
