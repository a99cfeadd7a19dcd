"""Batched speculative decoding: B requests draft and verify together, each with its own acceptance."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specter.errors import SpecterError
from specter.metrics import DecodeMetrics, GenerationResult, h2d_split
from specter.models.hybrid_experts import DRAFT
from specter.speculative.loop import decode_windows
from specter.speculative.window import draft_window
from specter.verify.accept import verify_batch

from .state import BatchState, refuse_rope_switch


BatchCommit = Callable[[int, list[int]], "bool | None"]  # (request, its tokens just committed); False: it ends


def generate_batch(engine, session, prompts: list[torch.Tensor], max_new_tokens: int,
                   eos_token_id: int | None = None, on_commit: BatchCommit | None = None) -> list[GenerationResult]:
    """Greedy speculative decoding of B requests on one shared cache (the call's offload `session`; None: every
    expert resident); one result per request.

    Every pass drafts k tokens for all requests in lockstep (the lookahead counters and the prefetch
    plan see the whole batch's routing) and verifies k + 1 positions of all requests in one target
    forward, so each expert a layer needs is loaded once for every request that routes to it. Each
    request accepts its own prefix; a request that is done (max_new_tokens or EOS) rides along, keeps
    no KV and commits nothing, so it never changes the others' tokens and its length stays bounded.
    `on_commit(request, tokens)` hears each request's commits as they happen (they may run past its EOS: its
    result is cut there); returning False ends that request there (it rides along from then on).
    """
    if not engine.config.greedy:
        raise SpecterError("batched decoding is greedy only: use temperature=0")
    call = engine.begin_request(session)
    refuse_rope_switch(engine.model, prompts, max_new_tokens)
    state = BatchState(engine.model, prompts, static_batch_cache(engine, prompts, max_new_tokens))
    metrics = [DecodeMetrics(engine.model.device) for _ in prompts]
    first = state.prefill(call.executor).argmax(dim=-1).tolist()  # [B]
    state.commit_first(first)
    commit = on_commit or (lambda request, tokens: None)
    ended = [commit(r, [token]) is False for r, token in enumerate(first)]  # what on_commit stopped
    for m in metrics:
        m.commit(1)
    call.end_prefill()
    decode_windows(BatchRequests(engine, state, metrics, max_new_tokens, eos_token_id, commit, ended), call)
    return _results(engine, call, state, metrics, max_new_tokens, eos_token_id)


@dataclass
class BatchRequests:
    """B requests after their prefill, as the window loop drives them: they draft in lockstep and verify in one
    target forward; `ended[r]`: request r's `commit` said stop."""

    engine: Any  # the SpecterEngine
    state: BatchState
    metrics: list[DecodeMetrics]
    max_new_tokens: int
    eos: int | None
    on_commit: BatchCommit
    ended: list[bool]

    def active(self) -> list[bool]:
        return active_requests(self.state, self.max_new_tokens, self.eos, self.ended)

    def next_window(self) -> int | None:
        """k = min(K, the most any active request still needs - 1); None once every request is done."""
        active = self.active()
        if not any(active):
            return None
        state = self.state
        return min(self.engine.config.k, max(self.max_new_tokens - len(state.generated(r)) - 1
                                             for r in range(len(active)) if active[r]))

    def draft(self, k: int) -> tuple[torch.Tensor, Any]:
        self.state.make_room(k + 1)
        return draft(self.engine, self.state, k, self.metrics)

    def verify(self, drafts: torch.Tensor, executor) -> list[tuple[int, list[int]]]:
        """(accepted, tokens to commit) per request (routed experts through the window's `executor`), a request
        already done keeping no KV and committing nothing."""
        _phase(self.metrics, "verify", DecodeMetrics.begin)
        outcome = verify_batch(self.engine.model, self.state, drafts, executor)
        _phase(self.metrics, "verify", DecodeMetrics.end)
        active = self.active()
        return [(n, tokens) if active[r] else (-1, []) for r, (n, tokens) in enumerate(outcome)]

    def commit(self, k: int, verified: list[tuple[int, list[int]]]) -> None:
        """Each request keeps its accepted prefix; an active one (n >= 0: `verify` gave the done ones -1) is
        counted and heard by `on_commit`."""
        self.state.commit([tokens for _, tokens in verified], [n for n, _ in verified])
        for r, (n, tokens) in enumerate(verified):
            if n >= 0:
                self.metrics[r].commit(len(tokens))
                self.metrics[r].window(k, n)
                self.ended[r] = self.on_commit(r, tokens) is False


def draft(engine, state: BatchState, k: int, metrics: list):
    """k draft tokens per request [B, k] and the window's plan (None without prefetch or drafts); all
    requests step together, their routing counted for the planner."""
    _phase(metrics, "draft", DecodeMetrics.begin)

    def step(i: int, previous: torch.Tensor | None) -> torch.Tensor:
        x = state.last if previous is None else previous  # [B, 1]
        mask, positions = state.step_inputs(offset=i, length=1)
        graph = None
        if state.static is not None:
            graph = engine.graphs.capture(state.batch_size, state.cache, state.mask.shape[1], mask, positions)
        if graph is not None:
            return graph.step(x, mask, positions).view(-1, 1)  # [B, 1]
        logits = engine.model.forward(x, state.cache, DRAFT, mask, positions,
                                      draft_workspace=engine.draft_workspace)  # [B, 1, V]
        return logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]

    with state.draft_scratch():
        tokens, plan = draft_window(k, step, engine.planner,
                                    lambda: engine.model.observe_draft_routing(engine.elb.observe))
    _phase(metrics, "draft", DecodeMetrics.end)
    return (torch.cat(tokens, dim=1) if tokens else state.last[:, :0]), plan


BATCH_CACHE_QUANTUM = 256  # static batch caches are sized in these steps, so short and long runs share a capture
# (the harness's 4-token warm-up and a 128-token run of 16-token prompts at K=16 both fit 256); attention covers
# every column each step, and DeepSeek-V2 re-expands its MLA latent over all of them, so it is kept short


def static_batch_cache(engine, prompts: list[torch.Tensor], max_new_tokens: int):
    """The engine's static KV cache for this batch, or None when the draft runs eagerly (no CUDA, graphs
    off). One cache (and captured graph) per (batch size, length), reused until either changes. Room for
    the longest request plus a few windows of holes; the batch state compacts it when the holes fill it."""
    if not (engine.config.cuda_graph and engine.model.device.type == "cuda"):
        return None
    k = engine.config.k
    needed = max(p.shape[-1] for p in prompts) + max_new_tokens + 4 * (k + 1)
    length = -(-needed // BATCH_CACHE_QUANTUM) * BATCH_CACHE_QUANTUM
    return engine.graphs.static_cache(len(prompts), length)


def _phase(metrics: list, name: str, mark) -> None:
    for m in metrics:
        mark(m, name)


def active_requests(state: BatchState, max_new_tokens: int, eos: int | None,
                    ended: list[bool] | None = None) -> list[bool]:
    """Per request: still decoding (below max_new_tokens, no EOS yet, and not `ended` by its caller)."""
    return [len(state.generated(r)) < max_new_tokens and not (eos is not None and eos in state.generated(r))
            and not (ended is not None and ended[r]) for r in range(state.batch_size)]


def _results(engine, call, state: BatchState, metrics: list, max_new_tokens: int,
             eos: int | None) -> list[GenerationResult]:
    """Per request: its tokens and metrics, plus the shared cache's stats."""
    eager = "off: eager (no static batch cache)"
    status = engine.graphs.status(state.batch_size) if state.static is not None else eager
    shared = engine.stats(call, metrics[0], batched=True, graph_status=status)
    return batch_results(generated_tokens(state), metrics, max_new_tokens, eos, shared)


def generated_tokens(state: BatchState) -> list[list[int]]:
    return [state.generated(r) for r in range(state.batch_size)]


def batch_results(generated: list[list[int]], metrics: list, max_new_tokens: int, eos: int | None,
                  shared: dict) -> list[GenerationResult]:
    """One result per request: its tokens (`generated`, cut at max_new_tokens / EOS) and its own metrics
    (over any per-request key in `shared`), plus the batch's `shared` stats, its throughput (all tokens /
    time until the last request's last token) and mean TPOT over requests."""
    summaries = [m.summary() for m in metrics]
    total = sum(s["generated_tokens"] for s in summaries)
    wall_ms = max(s["e2e_ms"] for s in summaries)
    shared = h2d_split(dict(shared), shared.get("prefill_h2d_bytes", 0), total - len(generated))
    batch = {"batch_size": len(generated),
             "throughput_tok_s": total / wall_ms * 1e3 if wall_ms > 0 else float("nan"),
             "mean_tpot_ms": sum(s["tpot_ms"] for s in summaries) / len(summaries)}
    results = []
    for tokens, summary in zip(generated, summaries):
        tokens = tokens[:max_new_tokens]
        if eos is not None and eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        results.append(GenerationResult(tokens, {**shared, **summary, **batch}))
    return results
