"""SpecMoEOff's batch mode: the batch split into two microbatches that take turns on one shared expert cache."""
from __future__ import annotations

import time

import torch

from specter.batch.engine import active_requests, batch_results, generated_tokens
from specter.batch.state import BatchState, refuse_rope_switch
from specter.errors import SpecterError
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid_experts import TARGET
from specter.speculative.loop import decode_windows
from specter.speculative.window import draft_window
from specter.verify.accept import verify_batch

MICROBATCHES = 2


class Microbatch:
    """Some requests of the batch: their target state, their own draft state (the separate draft's KV)."""

    def __init__(self, engine, prompts: list[torch.Tensor]) -> None:
        self.engine = engine
        self.target, self.draft = BatchState(engine.model, prompts), BatchState(engine.draft_model, prompts)
        self.metrics = [DecodeMetrics(engine.model.device) for _ in prompts]

    def prefill(self, executor) -> None:
        """Both states prefill their prompts (the target's routed experts through `executor`)."""
        first = self.target.prefill(executor).argmax(dim=-1).tolist()  # [b]
        self.draft.prefill()
        for state in (self.target, self.draft):
            state.commit_first(first)
        for m in self.metrics:
            m.commit(1)

    def active(self, max_new_tokens: int) -> list[bool]:
        return active_requests(self.target, max_new_tokens, None)

    def make_drafts(self, k: int):
        """k draft tokens [b, k] and the window's plan; one more step writes the last draft's KV (every
        request's draft cache then covers all k + 1 verified positions, so each keeps its accepted prefix
        like the target)."""
        engine = self.engine

        def step(i: int, previous: torch.Tensor | None) -> torch.Tensor:
            return self._draft_step(self.draft.last if previous is None else previous, i)  # [b, 1]

        tokens, plan = draft_window(k, step, engine.prefetcher,
                                    lambda: engine.draft_model.observe_draft_routing(engine.elb.observe))
        self._draft_step(tokens[-1], k)
        return torch.cat(tokens, dim=1), plan

    def commit(self, k: int, active: list[bool], outcome: list[tuple[int, list[int]]]) -> list[int]:
        """Both states keep the KV of each request's input and accepted drafts; the requests accepted."""
        tokens, accepted = [t for _, t in outcome], [n for n, _ in outcome]
        for state in (self.target, self.draft):
            state.commit(tokens, accepted)
        for m, was_active, n, new in zip(self.metrics, active, accepted, tokens):
            if was_active:
                m.commit(len(new))
                m.window(k, n)
        return accepted

    def _draft_step(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        mask, positions = self.draft.step_inputs(offset=offset, length=1)
        logits = self.engine.draft_model.forward(x, self.draft.cache, TARGET, mask, positions)  # [b, 1, V]
        return logits[:, -1].argmax(dim=-1, keepdim=True)  # [b, 1]


def generate_microbatches(engine, session, prompts: list[torch.Tensor],
                          max_new_tokens: int) -> list[GenerationResult]:
    """Greedy decoding of the batch as two microbatches taking turns (one speculative iteration each) on
    the shared LRU cache, K from the cost model; the turns run one after the other on the device."""
    if not engine.config.greedy:
        raise SpecterError("batched decoding is greedy only: use temperature=0")
    refuse_rope_switch(engine.model, prompts, max_new_tokens)
    call = engine.begin_request(session)
    half = (len(prompts) + 1) // MICROBATCHES
    micro = [Microbatch(engine, part) for part in (prompts[:half], prompts[half:]) if part]
    for m in micro:
        m.prefill(call.executor)
    call.end_prefill()
    decode_windows(TakingTurns(engine, call, micro, max_new_tokens), call)
    return _combined(engine, call, micro, max_new_tokens)


class TakingTurns:
    """The microbatches as the window loop drives them: one window each in turn, skipping those that are done;
    K from the engine's cost model."""

    def __init__(self, engine, call, micro: list[Microbatch], max_new_tokens: int) -> None:
        self.engine, self.call, self.micro, self.max_new_tokens = engine, call, micro, max_new_tokens
        self.turn = -1  # the microbatch whose window runs

    def next_window(self) -> int | None:
        for step in range(1, len(self.micro) + 1):
            turn = (self.turn + step) % len(self.micro)
            m = self.micro[turn]
            remaining = [self.max_new_tokens - len(m.target.generated(r)) - 1
                         for r, on in enumerate(m.active(self.max_new_tokens)) if on]
            if remaining:
                self.turn = turn
                return max(1, min(self.engine.choose_k(), max(remaining)))
        return None

    def draft(self, k: int) -> tuple[tuple, object]:
        """(the microbatch, its drafts [b, k], which requests were active, the window's start and loads so far),
        the plan."""
        m, started = self.micro[self.turn], (time.perf_counter(), self.call.loads)
        active = m.active(self.max_new_tokens)
        drafts, plan = m.make_drafts(k)
        return (m, drafts, active, started), plan

    def verify(self, drafted: tuple, executor) -> tuple:
        """Token-wise verification of the microbatch's k + 1 positions through the window's `executor`."""
        m, drafts, active, started = drafted
        return m, verify_batch(self.engine.model, m.target, drafts, executor), active, started

    def commit(self, k: int, verified: tuple):
        m, outcome, active, started = verified
        accepted = m.commit(k, active, outcome)
        return self.call.window(k, round(sum(accepted) / len(accepted)), [], started, None)


def _combined(engine, call, micro: list[Microbatch], max_new_tokens: int) -> list[GenerationResult]:
    shared = {**engine.stats(call, micro[0].metrics[0]), "microbatches": len(micro)}  # per-request keys give way
    generated = [tokens for m in micro for tokens in generated_tokens(m.target)]
    return batch_results(generated, [x for m in micro for x in m.metrics], max_new_tokens, None, shared)

