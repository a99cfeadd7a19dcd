"""Draft-ahead's branch: during the verify pass, the next window drafted from the window's likeliest rejection.

A window the target does not accept whole makes the next window draft its k tokens with the verify pass
unable to start. The branch guesses where and how the window ends instead: at the draft position with the
smallest margin between the draft's top two tokens, with the runner-up as the target's correction. During
the verify pass it drafts the window that would follow (over a KV cache of its own: the committed rows and
the window's draft rows up to that position), after draft-ahead's whole-window guess on the same side
stream: the captured draft steps share the draft kernels' workspace, so they never run at once. When the
target rejects exactly there and corrects to the runner-up, the next window takes the branch's drafts.
The target decides every committed token either way (greedy only).

The branch point stays on the device (no host sync at launch); the host reads it after the verify pass. The
branch's steps are queued after draft-ahead's (`SideSteps`); those never queued when its window is not taken
cost nothing.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import StaticCache

from specter.offload.draft_graph import DraftGraphCache, draft_chain
from specter.offload.host_reads import HostRead, read_when_reached
from specter.offload.side_steps import SideSteps
from specter.prefetch.lookahead import ExpertLookaheadBuffer
from specter.speculative.state import copy_rows


@dataclass
class BranchWindow:
    """Drafts made from a guessed rejection: `point` reads (position in the window, correction token) [2]."""

    point: HostRead
    steps: SideSteps  # the branch's draft steps: choices [1, 3] each (drafts, runner-ups, margins)

    def matches(self, accepted: int, correction: int) -> bool:
        """Whether the target rejected the window at the branch's position with the branch's token."""
        position, token = self.point.result().tolist()
        return accepted == position and correction == token


class DraftBranch:
    """The branch's KV cache (static, with its own captured step, where draft-ahead's is) and its lookahead
    counters (the routing of its drafts, the next window's plan when it is taken); it drafts on `stream`
    (draft-ahead's side stream; None on the CPU), at most `in_flight` steps unfinished (SideSteps)."""

    def __init__(self, model, compiled: bool, stream, in_flight: int) -> None:
        self.model, self.stream, self.in_flight = model, stream, in_flight
        self.elb = ExpertLookaheadBuffer(model.num_moe_layers, model.num_experts, model.device)
        self.graphs = DraftGraphCache(model, self.elb, compiled, choices=True)
        self.cache = None
        self.launches = self.used = 0

    def reset(self) -> None:
        self.cache, self.launches, self.used = None, 0, 0

    def begin_request(self, request_cache, length: int) -> None:
        """A request starts: a cache of the request cache's kind, `length` positions where static."""
        self.cache = self.graphs.side_cache(request_cache, length, 0)

    def launch(self, source, kv_length: int, choices: torch.Tensor, steps: int) -> BranchWindow:
        """Draft `steps` tokens after the window of `choices` [k, 3] (its drafts, runner-ups, margins) rejected
        at its smallest margin; `source` (draft-ahead's cache) holds the committed rows and the window's
        draft rows when the side stream gets here. Its steps queue as SideSteps."""
        k = choices.shape[0]
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            position = choices[:, 2].argmin()  # device scalar
            point = torch.stack([position, choices[position, 1]])  # [2]
            read = read_when_reached(point)  # queued before any draft step: done long before it is read
            self._copy_rows(source, kv_length, k, position)
            self.elb.clear()
        graph = self.graphs.graph(None, self.cache)
        chain = draft_chain(self.model, graph, self.cache, self.elb, point[1:], steps)
        self.launches += 1
        return BranchWindow(read, SideSteps(chain, self.stream, self.in_flight if graph is not None else 0))

    def collect(self, branch: BranchWindow, accepted: int, correction: int, k: int) -> list[torch.Tensor] | None:
        """The outputs of `branch`'s first `k` steps ([1, 3] each; its steps not yet queued are queued now)
        when the target rejected where it guessed, else None. The caller has the current stream wait for the
        side stream before it reads them, then takes the branch's counts (`move_counts`)."""
        if not branch.matches(accepted, correction):
            return None
        outputs = branch.steps.finish()
        if len(outputs) < k:
            return None
        self.used += 1
        return outputs[:k]

    def move_counts(self, elb) -> None:
        """The branch's routing counts into `elb` (the engine's counters, from which the next window is
        planned), on the current stream."""
        elb.counts.copy_(self.elb.counts)

    def _copy_rows(self, source, kv_length: int, k: int, position: torch.Tensor) -> None:
        """The branch's cache: `source`'s committed rows and the window's draft rows before the correction
        (kv_length + 1 + position of them; the length set on the device where the cache is static)."""
        if isinstance(self.cache, StaticCache):
            copy_rows(self.cache, source, kv_length + k, kv_length + k)
            for layer in self.cache.layers:
                if layer.is_initialized:
                    layer.cumulative_length.copy_(position + kv_length + 1)
        else:
            keep = kv_length + 1 + int(position)
            copy_rows(self.cache, source, keep, keep)
