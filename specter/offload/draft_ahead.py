"""Draft-ahead: while the target verifies a window, the draft drafts the next one on a side stream.

The verify pass mostly waits for expert copies with the SMs idle. During it, the draft continues from the
window's last draft token over a KV cache of its own: one step gives its guess of the target's bonus token,
k more steps the next window's drafts. When the target accepts the whole window and its bonus token equals
the guess, the next window takes those drafts and skips its draft phase; otherwise they are dropped. The
verify decides every committed token either way, so output is unchanged (greedy only).

The draft's cache holds the committed target rows (copied from the request's cache before the verify
pass writes there) and the draft's own rows of the window being verified: copied too when that window
was drafted normally, kept from the previous draft-ahead when it was drafted ahead.

With a branch (`specter.offload.draft_branch`), the window's likeliest rejection is drafted from too, on
a stream of its own, and the next window takes those drafts when the target rejects there.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import StaticCache

from specter.models.hybrid_experts import DRAFT
from specter.offload.draft_branch import BranchWindow, DraftBranch
from specter.offload.draft_graph import DraftGraphCache
from specter.offload.host_reads import HostRead, read_when_reached, recorded_event
from specter.speculative.sampling import draft_choices
from specter.speculative.state import copy_rows, rope_switch


@dataclass
class AheadWindow:
    """Drafts made ahead for a window of `k` tokens, usable when the target's bonus token equals `guess`
    (None: drafted by the branch, whose cache holds the window's draft rows)."""

    k: int
    guess: HostRead | None  # reads [1]: the draft's guess of the bonus token after the verified window
    choices: torch.Tensor  # [k, 3] the next window's drafts, their runner-ups and margins ([k, 1]: drafts only)

    @property
    def tokens(self) -> torch.Tensor:
        return self.choices[:, 0]  # [k]


@dataclass
class Launched:
    """What one launch drafts during a verify pass: the next window if the window is accepted whole, and the
    branch's (None without one); `window_k(committed)`: the next window's length after `committed` tokens."""

    whole: AheadWindow
    branch: BranchWindow | None
    window_k: object
    whole_done: object = None  # an event after the whole window's drafts (None on the CPU)


def draft_ahead_problem(config, model) -> str:
    """Why draft-ahead cannot run for this engine ("" when it can; it needs greedy decoding and one RoPE)."""
    if not config.greedy:
        return "sampling (draft-ahead is greedy only)"
    if rope_switch(model.hf.config) is not None:
        return "longrope (the window length depends on the position)"
    return ""


class DraftAhead:
    """The draft's own KV cache (static, with its own captured step, where the engine's is), its side stream,
    the drafts of the window being verified and, with `branch`, a DraftBranch."""

    def __init__(self, model, elb, compiled: bool, k_max: int, branch: bool = False) -> None:
        self.model, self.elb, self.k_max = model, elb, k_max
        self.graphs = DraftGraphCache(model, elb, compiled, choices=branch)
        self.cuda = model.device.type == "cuda"
        self.stream = torch.cuda.Stream(model.device) if self.cuda else None
        self.branch = DraftBranch(model, compiled, self.stream) if branch else None
        self.cache = None
        self.launches = self.used = 0

    def reset(self) -> None:
        """Any request starts: nothing drafted ahead yet (a batch never drafts ahead)."""
        self.cache, self.launches, self.used = None, 0, 0
        if self.branch is not None:
            self.branch.reset()

    def begin_request(self, request_cache, length: int, kv_length: int) -> None:
        """A single request starts: a static cache (and captured step) beside a static request cache, else a
        dynamic one (the branch's too)."""
        self.cache = self.graphs.side_cache(request_cache, length, kv_length)  # rows copied in at each launch
        if self.branch is not None:
            self.branch.begin_request(request_cache, length)

    def window_k(self, remaining: int):
        """committed -> the next window's length once `committed` of the `remaining` tokens are committed."""
        return lambda committed: min(self.k_max, remaining - committed - 1)

    def launch(self, state, drafts: torch.Tensor, choices: torch.Tensor | None, window: AheadWindow | None,
               remaining: int) -> Launched | None:
        """Start drafting the window after `drafts` [k] of `state` (a StateManager) on the side stream, and
        with a branch and the window's `choices` [k, 3], the window after its likeliest rejection; `window`:
        the drafts made ahead that this window took (None: drafted now); `remaining`: tokens the request
        still needs. The request's cache may be written once this returns."""
        window_k = self.window_k(remaining)
        kv_length, k, next_k = state.kv_length, drafts.numel(), window_k(drafts.numel() + 1)
        if next_k < 1 or k == 0:
            return None
        drafted_ahead = window is not None
        # committed rows, and the window's draft rows where the request's cache still holds them (static)
        rows = kv_length if drafted_ahead or not isinstance(state.cache, StaticCache) else kv_length + k
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # the window's drafts and KV are written
        with self._side():  # a window drafted ahead keeps the draft rows of it (the branch's: copied here)
            if drafted_ahead and window.guess is None:
                copy_rows(self.cache, self.branch.cache, kv_length + k, kv_length + k)
            copy_rows(self.cache, state.cache, rows, kv_length + k if drafted_ahead else rows)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)  # the verify pass writes after the copy
        with self._side():
            if not drafted_ahead and rows == kv_length:  # a dynamic cache dropped the window's draft rows
                window_inputs = torch.cat([state.uncached().view(-1), drafts[:-1]]).view(1, -1)  # [1, k]
                self.model.forward(window_inputs, self.cache, DRAFT)
            guess = self._draft(drafts[-1:], 1)[:, 0]  # [1]: the draft's guess of the bonus token
            guess_read = read_when_reached(guess)  # read after the verify pass without waiting for what follows
            steps = self._draft(guess, next_k)  # [next_k, 3]
            whole_done = recorded_event(self.cuda)
        branch = None
        if self.branch is not None and choices is not None and window_k(1) >= 1:
            branch = self.branch.launch(self.cache, kv_length, choices, window_k(1))  # after, on the same stream
        self.launches += 1
        return Launched(AheadWindow(next_k, guess_read, steps), branch, window_k, whole_done)

    def collect(self, launched: Launched | None, k: int, accepted: int, new_tokens: list[int]) -> AheadWindow | None:
        """After the verify pass: the drafts made ahead if the whole window was accepted with the guessed
        bonus token, or the branch's if it was rejected where and as the branch guessed; else None and the
        draft's counts of them cleared. The host waits for no draft step: the device does, for those it needs."""
        if launched is None:
            self._wait_side()
            return None
        whole = launched.whole
        if accepted == k and new_tokens[-1] == int(whole.guess.result()[0]):
            self.used += 1
            if self.cuda:  # the next verify pass reads them on this stream (the branch may still be drafting)
                torch.cuda.current_stream().wait_event(launched.whole_done)
                whole.choices.record_stream(torch.cuda.current_stream())
            return whole
        self._wait_side()  # the next draft steps share the draft kernels' workspace with the side stream's
        if launched.branch is not None:
            next_k = launched.window_k(len(new_tokens))
            choices = self.branch.collect(launched.branch, accepted, new_tokens[-1], next_k, self.elb)
            if choices is not None:
                return AheadWindow(next_k, None, choices)
        self.elb.clear()
        return None

    def stats(self) -> dict:
        """"on" with the request's launches and the windows that took their drafts ("off" for a batch)."""
        if self.cache is None:
            return {"draft_ahead": "off: batched decoding (single requests only)"}
        stats = {"draft_ahead": "on", "draft_ahead_launches": self.launches, "draft_ahead_windows": self.used}
        if self.branch is not None:
            stats.update(draft_branch_launches=self.branch.launches, draft_branch_windows=self.branch.used)
        return stats

    def _wait_side(self) -> None:
        """The current stream waits for everything queued on the side stream (the host does not)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def _draft(self, token: torch.Tensor, steps: int) -> torch.Tensor:
        """`steps` greedy draft choices [steps, 3] (or [steps, 1]: tokens only, without a branch) chained from
        `token` [1] over the draft's cache; routing counted."""
        graph = self.graphs.graph(None, self.cache)
        out = []
        observing = nullcontext() if graph is not None else self.model.observe_draft_routing(self.elb.observe)
        with observing:
            for _ in range(steps):
                if graph is not None:
                    choice = graph.step_choices(token)  # [1, 3] or [1, 1]
                else:
                    choice = draft_choices(self.model.forward(token.view(1, 1), self.cache, DRAFT)[0, -1:])
                out.append(choice)
                token = choice[:, 0]
        return torch.cat(out)
