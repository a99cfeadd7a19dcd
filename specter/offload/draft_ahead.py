"""Draft-ahead: while the target verifies a window, the draft drafts the next one on a side stream.

The verify pass mostly waits for expert copies with the SMs idle. During it, the draft continues from the
window's last draft token over a KV cache of its own: one step gives its guess of the target's bonus token,
k more steps the next window's drafts. When the target accepts the whole window and its bonus token equals
the guess, the next window takes those drafts and skips its draft phase; otherwise they are dropped. The
verify decides every committed token either way, so output is unchanged (greedy only).

The draft's cache holds the committed target rows (copied from the request's cache before the verify
pass writes there) and the draft's own rows of the window being verified: copied too when that window
was drafted normally, kept from the previous draft-ahead when it was drafted ahead.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from specter.models.hybrid_experts import DRAFT
from specter.offload.draft_graph import DraftGraphCache
from specter.speculative.state import copy_rows, rope_switch


@dataclass
class AheadWindow:
    """Drafts made ahead for a window of `k` tokens, usable when the target's bonus token equals `guess`."""

    k: int
    guess: torch.Tensor  # [1] the draft's guess of the bonus token after the verified window
    tokens: torch.Tensor  # [k] the next window's drafts


def draft_ahead_problem(config, model) -> str:
    """Why draft-ahead cannot run for this engine ("" when it can; it needs greedy decoding and one RoPE)."""
    if not config.greedy:
        return "sampling (draft-ahead is greedy only)"
    if rope_switch(model.hf.config) is not None:
        return "longrope (the window length depends on the position)"
    return ""


class DraftAhead:
    """The draft's own KV cache (static, with its own captured step, where the engine's is), its side stream,
    and the drafts of the window being verified."""

    def __init__(self, model, elb, compiled: bool) -> None:
        self.model, self.elb = model, elb
        self.graphs = DraftGraphCache(model, elb, compiled)
        self.cuda = model.device.type == "cuda"
        self.stream = torch.cuda.Stream(model.device) if self.cuda else None
        self.cache = None
        self.launches = self.used = 0

    def reset(self) -> None:
        """Any request starts: nothing drafted ahead yet (a batch never drafts ahead)."""
        self.cache, self.launches, self.used = None, 0, 0

    def begin_request(self, request_cache, length: int, kv_length: int) -> None:
        """A single request starts: a static cache (and captured step) beside a static request cache, else a
        dynamic one."""
        if isinstance(request_cache, StaticCache):  # its rows are copied in at each launch
            self.cache = self.graphs.static_cache(None, length, request_cache.max_cache_len)
            self.graphs.capture(None, self.cache, kv_length)
        else:
            self.cache = DynamicCache(config=self.model.hf.config)

    def launch(self, state, drafts: torch.Tensor, drafted_ahead: bool, next_k: int) -> AheadWindow | None:
        """Start drafting `next_k` tokens after the window `drafts` [k] of `state` (a StateManager), on the
        side stream; the request's cache may be written again as soon as this returns."""
        if next_k < 1 or drafts.numel() == 0:
            return None
        kv_length, k = state.kv_length, drafts.numel()
        # committed rows, and the window's draft rows where the request's cache still holds them (static)
        rows = kv_length if drafted_ahead or not isinstance(state.cache, StaticCache) else kv_length + k
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # the window's drafts and KV are written
        with self._side():  # a window drafted ahead keeps the draft cache's own rows of it
            copy_rows(self.cache, state.cache, rows, kv_length + k if drafted_ahead else rows)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)  # the verify pass writes after the copy
        with self._side():
            if not drafted_ahead and rows == kv_length:  # a dynamic cache dropped the window's draft rows
                window_inputs = torch.cat([state.uncached().view(-1), drafts[:-1]]).view(1, -1)  # [1, k]
                self.model.forward(window_inputs, self.cache, DRAFT)
            steps = self._draft(drafts[-1:], next_k + 1)  # [next_k + 1]: the guess, then the drafts
        self.launches += 1
        return AheadWindow(next_k, steps[:1], steps[1:])

    def collect(self, ahead: AheadWindow | None, k: int, accepted: int, new_tokens: list[int]) -> AheadWindow | None:
        """After the verify pass: the drafts made ahead if the whole window was accepted with the guessed
        bonus token, else None and the draft's counts of them cleared."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        if ahead is None:
            return None
        if accepted == k and new_tokens[-1] == int(ahead.guess[0]):
            self.used += 1
            if self.cuda:  # made on the side stream, read by the next verify pass on this one
                ahead.tokens.record_stream(torch.cuda.current_stream())
            return ahead
        self.elb.clear()
        return None

    def stats(self) -> dict:
        """"on" with the request's launches and the windows that took their drafts ("off" for a batch)."""
        if self.cache is None:
            return {"draft_ahead": "off: batched decoding (single requests only)"}
        return {"draft_ahead": "on", "draft_ahead_launches": self.launches, "draft_ahead_windows": self.used}

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def _draft(self, token: torch.Tensor, steps: int) -> torch.Tensor:
        """`steps` greedy draft tokens [steps] chained from `token` [1] over the draft's cache; routing counted."""
        graph = self.graphs.graph(None, self.cache)
        out = []
        observing = nullcontext() if graph is not None else self.model.observe_draft_routing(self.elb.observe)
        with observing:
            for _ in range(steps):
                if graph is not None:
                    token = graph.step(token)
                else:
                    token = self.model.forward(token.view(1, 1), self.cache, DRAFT)[0, -1].argmax(-1, keepdim=True)
                out.append(token)
        return torch.cat(out)
