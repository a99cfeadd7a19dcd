"""SpecMoEOff's batch mode: the batch split into two microbatches that take turns on one shared expert cache."""
from __future__ import annotations

import time

import torch

from specter.batch.engine import active_requests, batch_results, generated_tokens
from specter.batch.state import BatchState, refuse_rope_switch
from specter.errors import SpecterError
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid_experts import TARGET
from specter.prefetch.quality import PrefetchQuality
from specter.spec.sampling import greedy_accept_batch

MICROBATCHES = 2


class Microbatch:
    """Some requests of the batch: their target state, their own draft state (the separate draft's KV)."""

    def __init__(self, engine, prompts: list[torch.Tensor]) -> None:
        self.engine = engine
        self.target, self.draft = BatchState(engine.model, prompts), BatchState(engine.draft_model, prompts)
        self.metrics = [DecodeMetrics(engine.model.device) for _ in prompts]

    def prefill(self) -> None:
        first = self.target.prefill().argmax(dim=-1).tolist()  # [b]
        self.draft.prefill()
        for state in (self.target, self.draft):
            state.commit_first(first)
        for m in self.metrics:
            m.commit(1)

    def active(self, max_new_tokens: int) -> list[bool]:
        return active_requests(self.target, max_new_tokens, None)

    def speculate(self, k: int, max_new_tokens: int, quality: PrefetchQuality) -> None:
        """Draft k tokens per request on the draft's KV, verify k + 1 positions token-wise, commit both."""
        engine, active, start = self.engine, self.active(max_new_tokens), time.perf_counter()
        engine.begin_window()
        drafts = self._draft(k)
        mask, positions = self.target.step_inputs(offset=0, length=k + 1)
        verify_input = torch.cat([self.target.last, drafts], dim=1)  # [b, k+1]
        logits = engine.model.forward(verify_input, self.target.cache, TARGET, mask, positions)  # [b, k+1, V]
        outcome = greedy_accept_batch(drafts, logits)
        tokens, accepted = [t for _, t in outcome], [n for n, _ in outcome]
        for state in (self.target, self.draft):
            state.commit(tokens, accepted)  # both keep the KV of each request's input and accepted drafts
        for m, was_active, n, new in zip(self.metrics, active, accepted, tokens):
            if was_active:
                m.commit(len(new))
                m.window(k, n)
        mean_accepted = round(sum(accepted) / len(accepted))
        engine._account(_window(k, mean_accepted, (time.perf_counter() - start) * 1e3), quality)

    def _draft(self, k: int) -> torch.Tensor:
        """k draft tokens [b, k]; one more step writes the last draft's KV (every request's draft cache then
        covers all k + 1 verified positions, so each keeps its accepted prefix like the target)."""
        engine, tokens, x = self.engine, [], self.draft.last  # [b, 1]
        with engine.draft_model.observe_draft_routing(engine.elb.observe):
            engine.prefetcher.begin_window(k)
            for i in range(k):
                x = self._draft_step(x, i)
                tokens.append(x)
                engine.prefetcher.after_draft_token(i + 1)
            engine.prefetcher.end_window()
        self._draft_step(x, k)
        return torch.cat(tokens, dim=1)

    def _draft_step(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        mask, positions = self.draft.step_inputs(offset=offset, length=1)
        logits = self.engine.draft_model.forward(x, self.draft.cache, TARGET, mask, positions)  # [b, 1, V]
        return logits[:, -1].argmax(dim=-1, keepdim=True)  # [b, 1]


def generate_microbatches(engine, prompts: list[torch.Tensor], max_new_tokens: int) -> list[GenerationResult]:
    """Greedy decoding of the batch as two microbatches taking turns (one speculative iteration each) on
    the shared LRU cache, K from the cost model; the turns run one after the other on the device."""
    if not engine.config.greedy:
        raise SpecterError("batched decoding is greedy only: use temperature=0")
    refuse_rope_switch(engine.model, prompts, max_new_tokens)
    engine._reset()
    half = (len(prompts) + 1) // MICROBATCHES
    micro = [Microbatch(engine, part) for part in (prompts[:half], prompts[half:]) if part]
    for m in micro:
        m.prefill()
    engine.runtime.residency.take_demand()  # the prefills' routing is not a verify window
    quality = PrefetchQuality()
    while any(any(m.active(max_new_tokens)) for m in micro):
        for m in micro:
            remaining = [max_new_tokens - len(m.target.generated(r)) - 1
                         for r, on in enumerate(m.active(max_new_tokens)) if on]
            if remaining:
                m.speculate(max(1, min(engine.choose_k(), max(remaining))), max_new_tokens, quality)
    return _combined(engine, micro, max_new_tokens, quality)


def _combined(engine, micro: list[Microbatch], max_new_tokens: int, quality: PrefetchQuality) -> list[GenerationResult]:
    shared = {**engine._stats(micro[0].metrics[0], quality), "microbatches": len(micro)}  # per-request keys give way
    generated = [tokens for m in micro for tokens in generated_tokens(m.target)]
    return batch_results(generated, [x for m in micro for x in m.metrics], max_new_tokens, None, shared)


def _window(k: int, accepted: int, ms: float):
    """The engine's record of one iteration (imported here: the engine module imports this one)."""
    from baselines.specmoeoff.engine import Window
    return Window(k, accepted, [], ms, None)
