"""SpecterEngine.generate: the speculative decode loop (draft K with INT4 experts, verify once, commit)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import StaticCache

from specter.batch.engine import generate_batch
from specter.config import MAX_CACHE_LEN, SpecterConfig
from specter.inputs import check_batch, check_prompt, is_batch
from specter.kernels.moe_align import MoEWorkspace
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import DRAFT
from specter.draft.ahead import DraftAhead, Launched
from specter.draft.graph import DraftGraphCache
from specter.mechanisms import as_run, resolve
from specter.offload.runtime import OffloadConfig, offload_session
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import (
    EARLY_READ_FRACTION,
    INITIAL_CHUNK,
    PREFETCH_CHUNK,
    NoPrefetch,
    PrefetchPlanner,
    WindowPlan,
    early_read_layer,
)
from specter.speculative.sampling import next_token
from specter.speculative.state import StateManager, window_length
from specter.speculative.call import DecodeCall
from specter.speculative.loop import decode_windows
from specter.speculative.request import OneRequest
from specter.speculative.window import draft_window
from specter.text import TextResult, generate_text


class SpecterEngine:
    """Speculative decoding on one shared-instance hybrid model.

    Each iteration: the draft (INT4 experts) proposes k = min(K, remaining - 1) tokens from the
    committed prefix while its routing is counted and turned into prefetches of FP experts; the
    target verifies them in one forward over k + 1 positions (expert-wise, cache hits first); the
    state manager commits the accepted prefix plus the correction or bonus token.
    Greedy output equals the target's greedy output; sampling preserves the target distribution.
    `config` is what was asked; `self.config` what runs (`specter.mechanisms.resolve`: K resolved, a mechanism
    that cannot apply here switched off), and `self.mechanisms` says which ran and why not.

    `begin_request(session)` starts a call (`specter.speculative.call.DecodeCall`: its offload session,
    accounting and generator, passed to what needs them); the windows of a single request
    (`specter.speculative.request.OneRequest`) or a batch (`specter.batch.engine.BatchRequests`) then run in
    `specter.speculative.loop.decode_windows` on that call; `stats(call, metrics)` at the end. They run inside
    `generate`, which opens the call's offload session; every draft forward is given the engine's draft workspace
    (`draft_workspace`, which its captured draft steps point into).
    """

    name = "specter"
    batch_mode = True  # generate() also takes a list of prompts

    def __init__(self, model: HybridMoEModel, config: SpecterConfig | None = None,
                 keep_raw_experts: bool = True) -> None:
        """`keep_raw_experts=False`: with residual transfer, the host keeps only the experts' residual blobs (the
        raw experts go as they are encoded, about half the host memory in bf16); a system that reads raw experts
        cannot serve the model afterwards."""
        self.model = model
        config = config or SpecterConfig()
        config.check_against(model.num_experts)
        resolved = resolve(config, model)
        self.config, self.mechanisms = resolved.config, resolved.mechanisms
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        self.draft_workspace, self.verify_workspace = MoEWorkspace(), MoEWorkspace()  # its captured steps point in
        self.graphs = DraftGraphCache(model, self.elb, self.config.draft_compile, self.draft_workspace)
        slots = self.config.resident_experts_per_layer
        self.offload_config = None if slots is None else \
            dataclasses.replace(OffloadConfig.of(self.config), keep_raw=keep_raw_experts)
        runtime = None if self.offload_config is None else self.offload_config.attach(model)  # experts to the host
        self.planner = self._planner(runtime)
        self.ahead = DraftAhead(model, self.elb, self.config.draft_compile, self.config.k, self.draft_workspace) \
            if self.config.draft_ahead else None

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, eos_token_id: int | None = None,
                 on_commit: Callable | None = None) -> GenerationResult:
        """New tokens for a [1, T] prompt; stops early only at `eos_token_id` if one is given; `on_commit(tokens)`
        is called with each group of tokens as it commits (they may run past the EOS: the result is cut there).

        A batch (a list of prompts: token lists or tensors, any lengths) gives a list of results, one per
        request, decoded together (greedy; `specter.batch`); its `on_commit(request, tokens)` hears each
        request's commits, and a False from it ends that request there."""
        session = self._offload_session()
        vocab = self.model.vocab_size
        if is_batch(input_ids):
            prompts = check_batch(input_ids, max_new_tokens, vocab, self.model.max_positions)
            return generate_batch(self, session, prompts, max_new_tokens, eos_token_id, on_commit)
        prompt = check_prompt(input_ids, max_new_tokens, vocab, self.model.max_positions)
        return self._generate_one(session, prompt, max_new_tokens, eos_token_id, on_commit or (lambda tokens: None))

    def generate_text(self, prompt: str, max_new_tokens: int = 128, *, chat: bool = False,
                      stream: Callable[[str], None] | None = None) -> TextResult:
        """Text in, text out: `prompt` through the model's tokenizer (its chat template with `chat`), the new
        text streamed to `stream` as it commits (specter.text.generate_text)."""
        return generate_text(self, prompt, max_new_tokens, chat=chat, stream=stream)

    def _generate_one(self, session, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None,
                      on_commit: Callable[[list[int]], None]):
        call = self.begin_request(session)
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        self.graphs.capture(None, state.cache, state.kv_length)
        from_prompt = self._draft_from_prompt(state, max_new_tokens)
        first = int(next_token(state.prefill(call.executor), self.config, call.generator)[0])
        state.commit([first], kv_keep=state.kv_length)
        on_commit([first])
        metrics.commit(1)
        call.end_prefill()
        ahead = None if self.ahead is None else self.ahead.collect_prompt(from_prompt, first)
        decode_windows(OneRequest(self, call, state, metrics, max_new_tokens, eos_token_id, on_commit, ahead), call)
        tokens = _cut_at_eos(state.generated[:max_new_tokens], eos_token_id)
        stats = self.stats(call, metrics)
        stats["kv_cache_length"] = static_length(state.cache)  # the verify windows' KV, for a replay of them
        return GenerationResult(tokens, stats)

    def draft(self, state: StateManager, k: int, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, WindowPlan | None]:
        """k draft tokens [k] (and their distributions [k, V] when sampling from `generator`; tokens stay on the
        device) and the window's plan (None without prefetch or drafts).

        The draft router's choices go into the lookahead counters; the planner turns them into
        prefetches at chunk boundaries (`specter.speculative.window.draft_window`).
        """
        graph = self.graphs.graph(None, state.cache)

        def step(i: int, previous) -> tuple[torch.Tensor, torch.Tensor | None]:
            x = state.uncached() if previous is None else previous[0].view(1, 1)
            if graph is not None:
                return graph.step_token(x)[:, 0], None  # [1]
            logits = self.model.forward(x, state.cache, DRAFT, draft_workspace=self.draft_workspace)[0, -1]  # [V]
            return next_token(logits, self.config, generator)

        with state.draft_scratch():
            drafts, plan = draft_window(k, step, self.planner,
                                        lambda: self.model.observe_draft_routing(self.elb.observe))
        if not drafts:
            return torch.empty(0, dtype=torch.long, device=self.model.device), None, plan
        tokens, probs = zip(*drafts)
        return torch.cat(tokens), (torch.stack(probs) if probs[0] is not None else None), plan

    def begin_request(self, session) -> DecodeCall:
        """Same starting state for every request (cache emptied, counters cleared); the call's runtime over the
        offload `session` (None: every expert resident), its generator seeded."""
        if session is not None:
            session.reset()
        self.planner.begin_request(None if session is None else session.cache)
        self.elb.clear()
        if self.ahead is not None:
            self.ahead.reset()
        return DecodeCall.start(session, self.config, self.model.device)

    def stats(self, call: DecodeCall, metrics: DecodeMetrics, batched: bool = False,
              graph_status: str | None = None) -> dict:
        """The request's stats (`metrics`: its decode metrics, or a batch's first request's), with `mechanisms`:
        each mechanism's state in this call ("on" or "off: why"; `graph_status`: the draft step's capture,
        default the single request's)."""
        stats = call.accounting.stats(metrics, self.planner.traces, copy_idle=True)
        stats["draft_graph"] = self.graphs.status(None) if graph_status is None else graph_status
        mechanisms = as_run(self.mechanisms, stats["draft_graph"])
        if batched and mechanisms["draft_ahead"] == "on":
            mechanisms["draft_ahead"] = "off: batched requests (single requests only)"
        stats["mechanisms"] = mechanisms
        if self.ahead is not None and not batched:
            stats.update(self.ahead.stats())
        return stats

    def _offload_session(self):
        """The call's offload session (offload.runtime.offload_session: its cache and residency manager; None:
        every expert resident)."""
        config = self.offload_config
        return None if config is None else offload_session(self.model, config, self.verify_workspace)

    def _planner(self, runtime):
        """The prefetch planner over the offload runtime's cache, or NoPrefetch (nothing offloaded, or prefetch
        off)."""
        if runtime is None or not self.config.prefetch:
            return NoPrefetch()
        planner = PrefetchPlanner(PatternAnalyzer(self.elb), runtime.cache, initial_chunk=INITIAL_CHUNK,
                                  prefetch_chunk=PREFETCH_CHUNK)
        layer = early_read_layer(EARLY_READ_FRACTION, self.model.num_moe_layers)
        tap = None if layer is None else runtime.streams.tap((layer + 1, self.model.num_experts), torch.int32)
        if tap is not None:
            self.elb.set_tap(layer, tap)
        return planner

    def _draft_from_prompt(self, state: StateManager, max_new_tokens: int) -> Launched | None:
        """Before the prefill: draft-ahead's side cache for the request, and the first window drafted from the
        prompt while the prefill runs (None: nothing launched)."""
        if self.ahead is None:
            return None
        self.ahead.begin_request(state.cache, state.prompt_length + max_new_tokens + 2 * self.config.k + 4,
                                 state.kv_length)
        first_k = window_length(min(self.config.k, max_new_tokens - 2), state.prompt_length, state.switch)
        return self.ahead.launch_from_prompt(state, first_k)

    def _static_cache(self, length: int):
        """The engine's static KV cache when the draft step runs as a CUDA graph (else None: dynamic KV)."""
        if not (self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"):
            return None
        return self.graphs.static_cache(None, length + self.config.k + 2, MAX_CACHE_LEN)


def static_length(cache) -> int | None:
    """A static KV cache's preallocated length; None for a dynamic one."""
    if not isinstance(cache, StaticCache):
        return None
    return int(cache.get_max_length() if hasattr(cache, "get_max_length") else cache.max_cache_len)


def _cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens
