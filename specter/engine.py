"""SpecterEngine.generate: the speculative decode loop (draft K with INT4 experts, verify once, commit)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from specter.batch.engine import generate_batch
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.hooks import attributes_set
from specter.inputs import check_batch, check_prompt, is_batch
from specter.kernels.moe_align import MoEWorkspace
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import DRAFT
from specter.offload.draft_ahead import AheadWindow, DraftAhead, Launched, draft_ahead_problem
from specter.offload.draft_graph import DraftGraphCache
from specter.offload.residual_store import residual_dtype_problem
from specter.offload.runtime import OffloadConfig, serving
from specter.prefetch.lookahead import ExpertLookaheadBuffer, PatternAnalyzer
from specter.prefetch.planner import NoPrefetch, PrefetchPlanner, WindowPlan, early_read_layer
from specter.speculative.sampling import draft_choices, next_token, seeded_generator
from specter.speculative.state import StateManager
from specter.verify.accept import verify_and_accept
from specter.window_accounting import WindowAccounting


class SpecterEngine:
    """Speculative decoding on one shared-instance hybrid model.

    Each iteration: the draft (INT4 experts) proposes k = min(K, remaining - 1) tokens from the
    committed prefix while its routing is counted and turned into prefetches of FP experts; the
    target verifies them in one forward over k + 1 positions (expert-wise, cache hits first); the
    state manager commits the accepted prefix plus the correction or bonus token.
    Greedy output equals the target's greedy output; sampling preserves the target distribution.

    Window API (single-request and batched decoding): `begin_request`, `end_prefill`, then per window
    `begin_window`, the planner's draft hooks, `verifying(plan)` around the target pass, `close_window`;
    `stats` at the end. They run inside `generate`, which installs the engine's hooks on the model.
    """

    name = "specter"
    batch_mode = True  # generate() also takes a list of prompts

    def __init__(self, model: HybridMoEModel, config: SpecterConfig | None = None) -> None:
        self.model = model
        self.config = config or SpecterConfig(k=model.spec.default_k)
        self.config.check_against(model.num_experts)
        self.generator: torch.Generator | None = None
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        self.branching = self.config.draft_ahead and self.config.draft_ahead_branch  # draft steps give choices
        self.graphs = DraftGraphCache(model, self.elb, self.config.draft_compile, choices=self.branching)
        self.draft_workspace, self.verify_workspace = MoEWorkspace(), MoEWorkspace()
        slots = self.config.resident_experts_per_layer
        self.offload_config = None if slots is None else OffloadConfig.of(self.config)
        self.unavailable = offload_problem(self.offload_config, model.dtype)
        self.planner = NoPrefetch() if self.unavailable else self._planner()
        self.session = None  # the OffloadSession of the running call
        self.ahead_problem = draft_ahead_problem(self.config, model) if self.config.draft_ahead else "off"
        self.ahead = None if self.ahead_problem else self._draft_ahead()
        self.accounting = WindowAccounting()

    def available(self) -> tuple[bool, str]:
        return (False, self.unavailable) if self.unavailable else (True, "")

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32,
                 eos_token_id: int | None = None) -> GenerationResult:
        """New tokens for a [1, T] prompt; stops early only at `eos_token_id` if one is given.

        A batch (a list of prompts: token lists or tensors, any lengths) gives a list of results, one per
        request, decoded together (greedy; `specter.batch`)."""
        if self.unavailable:
            raise SpecterError(self.unavailable)
        with self._serving():
            vocab = self.model.vocab_size
            if is_batch(input_ids):
                return generate_batch(self, check_batch(input_ids, max_new_tokens, vocab), max_new_tokens, eos_token_id)
            return self._generate_one(check_prompt(input_ids, max_new_tokens, vocab), max_new_tokens, eos_token_id)

    def _generate_one(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None):
        self.begin_request()
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids, self._static_cache(input_ids.shape[1] + max_new_tokens))
        self.graphs.capture(None, state.cache, state.kv_length)
        from_prompt = self._draft_from_prompt(state, max_new_tokens)
        first = int(next_token(state.prefill(), self.config, self.generator)[0])
        state.commit([first], kv_keep=state.kv_length)
        metrics.commit(1)
        self.end_prefill()
        ahead = None if self.ahead is None else self.ahead.collect_prompt(from_prompt, first)
        while len(state.generated) < max_new_tokens and not _ended(state.generated, eos_token_id):
            remaining = max_new_tokens - len(state.generated)
            k = state.window(min(self.config.k, remaining - 1))
            new_tokens, accepted, plan, ahead = self.speculate(state, k, metrics, ahead, remaining)
            state.commit(new_tokens, kv_keep=state.kv_length + state.uncached_length + accepted)
            metrics.commit(len(new_tokens))
            metrics.window(k, accepted)
            self.close_window(plan)
        tokens = _cut_at_eos(state.generated[:max_new_tokens], eos_token_id)
        return GenerationResult(tokens, self.stats(metrics))

    def speculate(self, state: StateManager, k: int, metrics: DecodeMetrics, ahead: AheadWindow | None = None,
                  remaining: int = 0) -> tuple[list[int], int, WindowPlan | None, AheadWindow | None]:
        """One iteration: draft k tokens (or take `ahead`'s, drafted during the previous verify pass), verify
        k + 1 positions; (tokens to commit, n accepted, the window's plan, the next window's drafts if the
        draft-ahead made them and they are usable). `remaining`: tokens the request still needs (0: none
        drafted ahead)."""
        self.begin_window()
        metrics.begin("draft")
        taken = ahead if ahead is not None and ahead.k == k else None  # drafts made ahead for this window
        if ahead is not None and taken is None:
            self.ahead.discard()  # its routing counts are not this window's
        if taken is not None:
            drafts, draft_probs, choices, plan = taken.tokens, None, taken.choices, self.plan_ahead_window(k)
        else:
            drafts, draft_probs, choices, plan = self.draft(state, k)
        metrics.end("draft")
        metrics.begin("verify")
        launched = None if self.ahead is None else self.ahead.launch(state, drafts, choices, taken, remaining)
        with self.verifying(plan, None if launched is None else launched.advance):
            accepted, new_tokens = verify_and_accept(self.model, state, drafts, draft_probs, self.config,
                                                     self.generator)
        usable = None if self.ahead is None else self.ahead.collect(launched, k, accepted, new_tokens)
        metrics.end("verify")
        return new_tokens, accepted, plan, usable

    def plan_ahead_window(self, k: int) -> WindowPlan | None:
        """A window whose drafts were made ahead: its routing is already in the counters, so the planner
        closes it at once (no draft steps left to hide prefetches behind)."""
        self.planner.begin_window(k)
        return self.planner.end_window() if k else None

    def draft(self, state: StateManager, k: int
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, WindowPlan | None]:
        """k draft tokens [k] (and their distributions [k, V] when sampling; tokens stay on the device), with
        draft-ahead's branch their choices [k, 3] (token, runner-up, margin; else None) and the window's plan
        (None without prefetch or drafts).

        The draft router's choices go into the lookahead counters; the planner turns them into
        prefetches at chunk boundaries.
        """
        tokens, probs, choices, plan = [], [], [], None
        x = state.uncached()
        graph = self.graphs.graph(None, state.cache)
        observing = self.model.observe_draft_routing(self.elb.observe) if k else nullcontext()
        with state.draft_scratch(), observing:
            self.planner.begin_window(k)
            for i in range(k):
                if graph is not None:
                    choice, p = graph.step_choices(x), None  # [1, 3] with the branch, else [1, 1]
                    token = choice[:, 0]
                else:
                    logits = self.model.forward(x, state.cache, DRAFT)[0, -1]  # [V]
                    token, p = next_token(logits, self.config, self.generator)
                    choice = draft_choices(logits[None]) if self.branching else None
                tokens.append(token)
                choices.append(choice)
                probs.append(p)
                x = token.view(1, 1)
                self.planner.after_draft_token(i + 1)
            if k:
                plan = self.planner.end_window()
        empty = torch.empty(0, dtype=torch.long, device=self.model.device)
        drafted = torch.cat(tokens) if tokens else empty
        window_choices = torch.cat(choices) if self.branching and choices else None
        return drafted, (torch.stack(probs) if probs and probs[0] is not None else None), window_choices, plan

    def begin_request(self) -> None:
        """Same starting state for every request: cache emptied, counters cleared, generator seeded."""
        if self.session is not None:
            self.session.reset()
        self.planner.begin_request(None if self.session is None else self.session.cache)
        self.elb.clear()
        if self.ahead is not None:
            self.ahead.reset()
        self.accounting = WindowAccounting(self.session)
        self.generator = seeded_generator(self.config, self.model.device)

    def end_prefill(self) -> None:
        """The prefill is not a verify window (its copies are counted apart)."""
        self.accounting.end_prefill()

    def begin_window(self) -> None:
        """A window begins: its resident experts (I/O floor) and the cache's window for reload counts."""
        self.accounting.begin_window()
        if self.session is not None:
            self.session.cache.begin_window()

    def verifying(self, plan: WindowPlan | None, between_layers=None):
        """Context of the window's target pass: the residency manager verifies with `plan` (and calls
        `between_layers` after each MoE layer)."""
        return self.session.residency.verifying(plan, between_layers) if self.session is not None else nullcontext()

    def close_window(self, plan: WindowPlan | None) -> None:
        """After a verify pass: the target's routing against the plan, the working set and the I/O floor."""
        self.accounting.close_window(plan)

    def stats(self, metrics: DecodeMetrics) -> dict:
        """The request's stats (`metrics`: its decode metrics, or a batch's first request's)."""
        stats = self.accounting.stats(metrics, self.planner.traces, copy_idle=True)
        stats["draft_graph"] = self.graphs.status(None)
        stats.update({"draft_ahead": self.ahead_problem} if self.ahead is None else self.ahead.stats())
        return stats

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """The engine's hooks on the shared model for one call: its draft workspace on every layer and, when
        offloaded, its cache and residency manager (offload.runtime.serving)."""
        config = self.offload_config
        offload = nullcontext() if config is None else serving(self.model, config, self.verify_workspace)
        experts_hooks = attributes_set(self.model.experts, draft_workspace=self.draft_workspace,
                                       draft_decode_pairs=self.config.draft_decode_pairs)
        with experts_hooks, offload as session:
            self.session = session
            try:
                yield
            finally:
                self.session = None

    def _planner(self):
        """The prefetch planner (the experts move to the host store now), or NoPrefetch."""
        if self.offload_config is None:
            return NoPrefetch()
        runtime = self.offload_config.attach(self.model)
        if not self.config.prefetch:
            return NoPrefetch()
        cfg = self.config
        planner = PrefetchPlanner(PatternAnalyzer(self.elb), runtime.cache, initial_chunk=cfg.initial_chunk,
                                  prefetch_chunk=cfg.prefetch_chunk)
        layer = early_read_layer(cfg.early_read_fraction, self.model.num_moe_layers)
        tap = None if layer is None else runtime.streams.tap((layer + 1, self.model.num_experts), torch.int32)
        if tap is not None:
            self.elb.set_tap(layer, tap)
        return planner

    def _draft_from_prompt(self, state: StateManager, max_new_tokens: int) -> Launched | None:
        """Before the prefill: draft-ahead's side cache for the request, and with `draft_ahead_prompt` the first
        window drafted from the prompt while the prefill runs (None: nothing launched)."""
        if self.ahead is None:
            return None
        self.ahead.begin_request(state.cache, state.prompt_length + max_new_tokens + 2 * self.config.k + 4,
                                 state.kv_length)
        if not self.config.draft_ahead_prompt:
            return None
        return self.ahead.launch_from_prompt(state, min(self.config.k, max_new_tokens - 2))  # the first window's k

    def _draft_ahead(self) -> DraftAhead:
        """Draft-ahead (with its branch where configured); steps queued between verify layers only when
        offloaded (the residency manager's layers are the ticks)."""
        cfg = self.config
        in_flight = cfg.draft_ahead_in_flight if self.offload_config is not None else 0
        return DraftAhead(self.model, self.elb, cfg.draft_compile, cfg.k, cfg.draft_ahead_branch, in_flight)

    def _static_cache(self, length: int):
        """The engine's static KV cache when the draft step runs as a CUDA graph (else None: dynamic KV)."""
        if not (self.config.cuda_graph and self.config.greedy and self.model.device.type == "cuda"):
            return None
        return self.graphs.static_cache(None, length + self.config.k + 2, self.config.max_cache_len)


def _ended(tokens: list[int], eos: int | None) -> bool:
    return eos is not None and eos in tokens


def _cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def offload_problem(offload_config: OffloadConfig | None, dtype: torch.dtype) -> str:
    """Why this engine cannot run with its offload options ("" when it can, or when it does not offload): residual
    transfer on experts that are not 16-bit, or more pooled slots than the layers have."""
    if offload_config is None:
        return ""
    residual = residual_dtype_problem(dtype) if offload_config.residual else ""
    return residual or offload_config.pooled_problem()
