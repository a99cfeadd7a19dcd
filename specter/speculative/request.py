"""One request on a SpecterEngine as the window loop drives it: its drafts (made now, or ahead during the last
verify pass), the target's verification of them, the commit."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specter.metrics import DecodeMetrics
from specter.speculative.call import DecodeCall
from specter.speculative.state import StateManager
from specter.speculative.window import plan_drafted_window
from specter.verify.accept import verify_and_accept


@dataclass(frozen=True)
class Drafted:
    """A window's drafts: tokens [k] on the device, their distributions [k, V] when sampling, and the drafts made
    ahead that the window took (None: drafted now)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    ahead: Any = None  # draft.ahead.AheadWindow


@dataclass
class OneRequest:
    """A single request after its prefill on `engine` in `call`: its state, metrics and stream (`on_commit`), and
    the next window's drafts when the draft-ahead made them during the last verify pass (`ahead`)."""

    engine: Any  # the SpecterEngine
    call: DecodeCall
    state: StateManager
    metrics: DecodeMetrics
    max_new_tokens: int
    eos: int | None
    on_commit: Callable[[list[int]], object]
    ahead: Any = None  # draft.ahead.AheadWindow

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.state.generated)

    def next_window(self) -> int | None:
        """k = min(K, remaining - 1), within the rope's regime (`state.window`); None once done (or at EOS)."""
        if self.remaining <= 0 or (self.eos is not None and self.eos in self.state.generated):
            return None
        return self.state.window(min(self.engine.config.k, self.remaining - 1))

    def draft(self, k: int) -> tuple[Drafted, Any]:
        """The window's drafts: those made ahead when they are k long (their routing already counted: the planner
        closes the window at once), else k drafted now (`SpecterEngine.draft`); and the window's plan."""
        engine, ahead = self.engine, self.ahead
        self.metrics.begin("draft")
        taken = ahead if ahead is not None and ahead.k == k else None
        if ahead is not None and taken is None:
            engine.ahead.discard()  # its routing counts are not this window's
        if taken is not None:
            drafted, plan = Drafted(taken.tokens, None, taken), plan_drafted_window(engine.planner, k)
        else:
            tokens, probs, plan = engine.draft(self.state, k, self.call.generator)
            drafted = Drafted(tokens, probs)
        self.metrics.end("draft")
        return drafted, plan

    def verify(self, drafted: Drafted, executor) -> tuple[int, list[int]]:
        """The target over the k + 1 positions (routed experts through the window's `executor`), the draft-ahead
        drafting the next window meanwhile (side stream); (drafts accepted, tokens to commit)."""
        engine, state, k = self.engine, self.state, drafted.tokens.numel()
        self.metrics.begin("verify")
        launched = None if engine.ahead is None else engine.ahead.launch(state, drafted.tokens, drafted.ahead,
                                                                         self.remaining)
        accepted, new_tokens = verify_and_accept(engine.model, state, drafted.tokens, drafted.probs, engine.config,
                                                 self.call.generator, executor)
        self.ahead = None if engine.ahead is None else engine.ahead.collect(launched, k, accepted, new_tokens)
        self.metrics.end("verify")
        return accepted, new_tokens

    def commit(self, k: int, verified: tuple[int, list[int]]) -> None:
        """The accepted drafts and the correction (or bonus) token: KV kept through them, streamed, counted."""
        accepted, new_tokens = verified
        state = self.state
        state.commit(new_tokens, kv_keep=state.kv_length + state.uncached_length + accepted)
        self.on_commit(new_tokens)
        self.metrics.commit(len(new_tokens))
        self.metrics.window(k, accepted)
