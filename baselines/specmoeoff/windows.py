"""SpecMoEOff's side of a window: the call's runtime (its cost model fed by each window), and one request as the
window loop drives it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from baselines.specmoeoff.k_optimizer import CostModel, Window
from specter.metrics import DecodeMetrics
from specter.speculative.call import DecodeCall
from specter.speculative.state import StateManager
from specter.verify.accept import verify_and_accept


@dataclass
class SpecMoEOffCall(DecodeCall):
    """A call's runtime (`DecodeCall`) with the system's cost model, which each window's measurement updates, and
    the K of every window (`k_trace`)."""

    costs: CostModel | None = None
    k_trace: list[int] = field(default_factory=list)

    @property
    def loads(self) -> int:
        """Experts copied into the cache so far in this request (demand misses and prefetches)."""
        return self.session.cache.counters.loads

    def window(self, k: int, accepted: int, tokens: list[int], started: tuple[float, int],
               draft_ms: float | None) -> Window:
        """The window as the cost model sees it, `started` = (its perf_counter start, the loads then)."""
        start, loads = started
        return Window(k, accepted, tokens, (time.perf_counter() - start) * 1e3, draft_ms, self.loads - loads)

    def begin_window(self) -> None:
        """The resident experts before a window (its I/O floor)."""
        self.accounting.begin_window()

    def close_window(self, plan, window: Window) -> None:
        """After a window: the target's routing against the prefetch, the I/O floor, the cost model (a window
        with nothing drafted is not accounted)."""
        self.k_trace.append(window.k)
        if not window.k:
            self.accounting.skip_window()
            return
        self.accounting.close_window(plan)
        bandwidth = self.session.streams.measured_bandwidth()  # bytes per ms, None before any copy ended
        expert_bytes = self.session.store.expert_bytes
        self.costs.observe(window.k, window.accepted, window.ms, window.loads, draft_ms=window.draft_ms,
                           load_ms=expert_bytes / bandwidth if bandwidth else None)


@dataclass
class OneRequest:
    """A single request after its prefill, as the window loop drives it: the target's and the separate draft's
    states, each keeping the KV of the accepted prefix."""

    system: Any  # the SpecMoEOff
    call: SpecMoEOffCall
    target: StateManager
    draft_state: StateManager
    metrics: DecodeMetrics
    max_new_tokens: int

    def next_window(self) -> int | None:
        """k from the cost model (at most remaining - 1, within the rope's regime); None once done."""
        remaining = self.max_new_tokens - len(self.target.generated)
        return None if remaining <= 0 else self.target.window(min(self.system.choose_k(), remaining - 1))

    def draft(self, k: int) -> tuple[tuple, Any]:
        """(drafts [k], their distributions, ms per draft step, the window's start and loads so far), the
        window's plan."""
        started, loads = time.perf_counter(), self.call.loads
        self.metrics.begin("draft")
        drafts, draft_probs, draft_ms, plan = self.system.draft(self.draft_state, k, self.call.generator)
        self.metrics.end("draft")
        return (drafts, draft_probs, draft_ms, (started, loads)), plan

    def verify(self, drafted: tuple, executor) -> tuple:
        """The target's token-wise pass over the k + 1 positions through the window's `executor`."""
        drafts, draft_probs, draft_ms, started = drafted
        system = self.system
        self.metrics.begin("verify")
        accepted, tokens = verify_and_accept(system.model, self.target, drafts, draft_probs, system.config,
                                             self.call.generator, executor)
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
        return self.call.window(k, accepted, tokens, started, draft_ms)
