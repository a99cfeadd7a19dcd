"""Draft-ahead: while the target verifies a window, the draft drafts the next one on a side stream.

The verify pass mostly waits for expert copies with the SMs idle. During it, the draft continues from the
window's last draft token over a KV cache of its own: one step gives its guess of the target's bonus token,
k more steps the next window's drafts. When the target accepts the whole window and its bonus token equals
the guess, the next window takes those drafts and skips its draft phase; otherwise they are dropped. The
verify decides every committed token either way, so output is unchanged (greedy only).

The draft's cache holds the committed target rows (copied from the request's cache before the verify
pass writes there) and the draft's own rows of the window being verified: copied too when that window
was drafted normally, kept from the previous draft-ahead when it was drafted ahead.

The draft steps queue on the side stream as `SideSteps` when the verify pass starts; the host never waits
for a draft step, the device only for those it uses.

The first window has no verify pass before it: `launch_from_prompt` drafts it while the prefill runs, over
the draft's own KV rows of the prompt, from the draft's guess of the first token (`collect_prompt`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import StaticCache

from specter.models.hybrid_experts import DRAFT
from specter.draft.graph import DraftGraphCache, draft_chain
from specter.offload.host_reads import HostRead, read_when_reached, recorded_event
from specter.draft.side_steps import SideSteps
from specter.speculative.state import copy_rows, crop_cache, window_length


@dataclass
class AheadWindow:
    """Drafts made ahead for a window of `k` tokens (`guess`: the bonus token they follow)."""

    k: int
    guess: HostRead  # reads [1]
    choices: torch.Tensor  # [k, 1] the drafts

    @property
    def tokens(self) -> torch.Tensor:
        return self.choices[:, 0]  # [k]


@dataclass
class Launched:
    """What one launch drafts during a verify pass: `guess` (reads the draft's guess of the bonus token
    [1]) and the next window's steps if the window is accepted whole with it; `window_k(committed)`: the
    next window's length after `committed` tokens."""

    guess: HostRead
    whole: SideSteps
    window_k: Callable[[int], int]


class DraftAhead:
    """The draft's own KV cache (static, with its own captured step, where the engine's is), its side stream
    and the drafts of the window being verified."""

    def __init__(self, model, elb, compiled: bool, k_max: int, workspace=None) -> None:
        self.model, self.elb, self.k_max, self.workspace = model, elb, k_max, workspace  # the draft kernels' buffers
        self.graphs = DraftGraphCache(model, elb, compiled, workspace)
        self.cuda = model.device.type == "cuda"
        self.stream = torch.cuda.Stream(model.device) if self.cuda else None
        self.cache = None
        self.launches = self.used = self.prompt_used = 0
        self.launch_host_ms = 0.0  # host time in launch and launch_from_prompt

    def reset(self) -> None:
        """Any request starts: nothing drafted ahead yet (a batch never drafts ahead)."""
        self.cache, self.launches, self.used, self.prompt_used, self.launch_host_ms = None, 0, 0, 0, 0.0

    def begin_request(self, request_cache, length: int, kv_length: int) -> None:
        """A single request starts: a static cache (and captured step) beside a static request cache, else a
        dynamic one."""
        self.cache = self.graphs.side_cache(request_cache, length, kv_length)  # rows copied in at each launch

    def window_k(self, remaining: int, kv_length: int, switch: int | None) -> Callable[[int], int]:
        """committed -> the next window's length once `committed` of the `remaining` tokens are committed after
        `kv_length` cached positions (the engine's rule: `window_length`, a longrope `switch` included)."""
        return lambda committed: window_length(min(self.k_max, remaining - committed - 1),
                                               kv_length + committed - 1, switch)

    def launch(self, state, drafts: torch.Tensor, window: AheadWindow | None, remaining: int) -> Launched | None:
        """Start drafting the window after `drafts` [k] of `state` (a StateManager) on the side stream;
        `window`: the drafts made ahead that this window took (None: drafted now); `remaining`: tokens the
        request still needs. The request's cache may be written once this returns."""
        window_k = self.window_k(remaining, state.kv_length + state.uncached_length, state.switch)
        k, next_k = drafts.numel(), window_k(drafts.numel() + 1)
        if next_k < 1 or k == 0:
            return None
        started = time.perf_counter()
        self._copy_rows(state, k, window)
        graph = self.graphs.graph(None, self.cache)
        with self._side():
            if window is None and not isinstance(state.cache, StaticCache):  # the window's draft rows were dropped
                window_inputs = torch.cat([state.uncached().view(-1), drafts[:-1]]).view(1, -1)  # [1, k]
                self.model.forward(window_inputs, self.cache, DRAFT, draft_workspace=self.workspace)
            guess = list(self._chain(graph, drafts[-1:], 1))[0][:, 0]  # [1]
            guess_read = read_when_reached(guess)  # read after the verify pass without waiting for what follows
        whole = SideSteps(self._chain(graph, guess, next_k), self.stream)
        self.launches += 1
        self.launch_host_ms += (time.perf_counter() - started) * 1e3
        return Launched(guess_read, whole, window_k)

    def launch_from_prompt(self, state, k: int) -> Launched | None:
        """Before the prefill of `state` (a StateManager): draft the first window of `k` tokens from the prompt on
        the side stream while the target's prefill runs. The target's KV rows of the prompt do not exist yet,
        so this cache gets the draft's own (a draft forward over the prompt); the last position gives the
        draft's guess of the first token, k steps follow it. `collect_prompt` takes them."""
        if k < 1:
            return None
        started = time.perf_counter()
        crop_cache(self.cache, 0)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # the emptied cache, the prompt's ids
        with self._side():
            logits = self.model.forward(state.uncached(), self.cache, DRAFT,
                                        draft_workspace=self.workspace)[0, -1:]  # [1, V]
            guess = logits.argmax(dim=-1)  # [1]
            guess_read = read_when_reached(guess)
        graph = self.graphs.graph(None, self.cache)
        whole = SideSteps(self._chain(graph, guess, k), self.stream)
        self.launch_host_ms += (time.perf_counter() - started) * 1e3
        return Launched(guess_read, whole, lambda committed: k)

    def _chain(self, graph, token: torch.Tensor, steps: int):
        """`steps` greedy draft steps over the side cache from `token` [1] (specter.draft.graph.draft_chain)."""
        return draft_chain(self.model, graph, self.cache, self.elb, token, steps, self.workspace)

    def collect_prompt(self, launched: Launched | None, first: int) -> AheadWindow | None:
        """After the prefill: the first window's drafts made from the prompt if the draft guessed the target's
        first token `first`, else None (and their counts cleared)."""
        if launched is not None and first == int(launched.guess.result()[0]):
            self.prompt_used += 1
            return self._take_whole(launched)
        self.discard()
        return None

    def collect(self, launched: Launched | None, k: int, accepted: int, new_tokens: list[int]) -> AheadWindow | None:
        """After the verify pass: the drafts made ahead if the whole window was accepted with the guessed
        bonus token, else None and the draft's counts of them cleared. The host waits for no draft step: the
        device does, for those it needs before its next work (the current stream's draft steps share the draft
        kernels' workspace)."""
        if launched is None:
            self._wait_side()
            return None
        if accepted == k and new_tokens[-1] == int(launched.guess.result()[0]):
            self.used += 1
            return self._take_whole(launched)
        self.discard()
        return None

    def discard(self) -> None:
        """Drafts made ahead that the next window does not take: their counts cleared once the side stream's
        steps are done (the device waits; the window's own draft steps share their workspace)."""
        self._wait_side()
        self.elb.clear()

    def stats(self) -> dict:
        """"on" with the request's launches and the windows that took their drafts ("off" for a batch)."""
        if self.cache is None:
            return {"draft_ahead": "off: batched decoding (single requests only)"}
        return {"draft_ahead": "on", "draft_ahead_launches": self.launches, "draft_ahead_windows": self.used,
                "draft_ahead_prompt_windows": self.prompt_used, "draft_ahead_launch_host_ms": self.launch_host_ms}

    def _copy_rows(self, state, k: int, window: AheadWindow | None) -> None:
        """This cache: the request's committed rows, then the window's draft rows: the request's where it
        still holds them (static), its own where it drafted the window.

        Copied on the current stream, before the verify pass writes the request's cache; the side stream then
        waits for it. Nothing on the side stream reads or writes this cache now (`collect` waited for this
        cache's steps)."""
        kv_length = state.kv_length
        rows = kv_length if window is not None or not isinstance(state.cache, StaticCache) else kv_length + k
        copy_rows(self.cache, state.cache, rows, kv_length + k if window is not None else rows)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # the copy, the window's drafts and KV

    def _take_whole(self, launched: Launched) -> AheadWindow:
        """The drafts of `launched`'s whole-window guess, read on the current stream once those steps are done."""
        outputs = launched.whole.finish()
        if self.cuda:
            with self._side():
                done = recorded_event(True)
            torch.cuda.current_stream().wait_event(done)
        choices = self._on_current_stream(outputs)  # [next_k, 1]
        return AheadWindow(choices.shape[0], launched.guess, choices)

    def _on_current_stream(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The side stream's step outputs ([1, 1] each) as one tensor [n, 1] made on the current stream, which
        has waited for them; the outputs' memory is not reused until the current stream has read it."""
        if self.cuda:
            for output in outputs:
                output.record_stream(torch.cuda.current_stream())
        return torch.cat(outputs)

    def _wait_side(self) -> None:
        """The current stream waits for everything queued on the side stream (the host does not)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()
