"""The greedy draft step (a token per request through every layer, INT4 experts, lookahead counters) as a CUDA graph."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from specter.models.hybrid_experts import DRAFT
from specter.speculative.state import new_static_cache

WARMUP_STEPS = 2


def draft_step_fn(model, compiled: bool = False, workspace=None):
    """`(tokens [B, 1], cache, mask, positions) -> argmax(draft logits)` [B, 1], the draft kernels in
    `workspace` (a MoEWorkspace; None: their own buffers); with `compiled`, the same
    function through torch.compile (static shapes, so it compiles once per cache and batch shape): fewer,
    fused kernels for the dense part of each layer (norms, rotary, casts, copies). The fused kernels round
    to the model's dtype where eager rounds (`emulate_precision_casts`); their reductions may still sum in
    another order, so near-ties of the draft's logits can flip."""
    def step(tokens, cache, mask, positions):
        logits = model.forward(tokens, cache, DRAFT, mask, positions, draft_workspace=workspace)[:, -1]  # [B, V]
        return logits.argmax(dim=-1, keepdim=True)
    if not compiled:
        return step
    compiled_step = torch.compile(step, dynamic=False)
    limit = recompile_limit(model)

    def step_within_limit(tokens, cache, mask, positions):
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=4 * limit), \
                torch._inductor.config.patch(emulate_precision_casts=True):
            return compiled_step(tokens, cache, mask, positions)
    return step_within_limit


def draft_chain(model, graph, cache, elb, token: torch.Tensor, steps: int, workspace=None) -> Iterator[torch.Tensor]:
    """The greedy draft's tokens of `steps` steps chained from `token` [1] over `cache`, one step per item
    ([1, 1]): replays of `graph` when there is one, else eager forwards (draft kernels in `workspace`) with their
    routing counted into `elb` (drain an eager chain at once: its routing observer is installed while it runs)."""
    if graph is not None:
        for _ in range(steps):
            choice = graph.step_token(token)
            token = choice[:, 0]
            yield choice
        return
    with model.observe_draft_routing(elb.observe):
        for _ in range(steps):
            logits = model.forward(token.view(1, 1), cache, DRAFT, draft_workspace=workspace)  # [1, 1, V]
            choice = logits[0, -1:].argmax(dim=-1, keepdim=True)  # [1, 1]
            token = choice[:, 0]
            yield choice


def recompile_limit(model) -> int:
    """Compiled entries allowed per code object while compiling the draft step. The host tap's graph break
    (one MoE layer) leaves every decoder layer's forward a frame of its own, specialised on its layer index:
    one entry per layer and cache (the request's and draft-ahead's), where dynamo's default of 8 would run
    every layer past the eighth eagerly (a cache initialised or not, and a replaced cache, add entries)."""
    return max(int(torch._dynamo.config.recompile_limit), 8 * int(model.hf.config.num_hidden_layers))


class DraftStepGraph:
    """Captures `tokens -> argmax(draft logits)` once and replays it for every draft step.

    Needs fixed addresses and shapes: the static KV cache (its device-side length positions each
    step), static input tokens [B, 1], the lookahead counters and the draft kernels' `workspace`; a batch
    also has static mask [B, 1, 1, max_len] and position [B, 1] inputs, copied in before each replay.
    Capture happens on a side stream after warm-up steps, whose KV writes and counts are rolled back.
    """

    def __init__(self, model, cache, elb, kv_length: int, mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, compiled: bool = False, workspace=None) -> None:
        self.model, self.cache, self.elb = model, cache, elb
        self.step_fn = draft_step_fn(model, compiled, workspace)  # compiled at the first warm-up step
        batch = 1 if positions is None else positions.shape[0]
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)  # static input
        self.mask = None if mask is None else mask.clone()  # static inputs of a batch
        self.positions = None if positions is None else positions.clone()
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), model.observe_draft_routing(elb.observe):
            for _ in range(WARMUP_STEPS):
                self._step()
                rollback(cache, elb, kv_length)
            with torch.cuda.graph(self.graph, stream=stream):
                self.next_token = self._step()  # [B, 1], static output
        torch.cuda.current_stream().wait_stream(stream)
        rollback(cache, elb, kv_length)

    def _step(self) -> torch.Tensor:
        return self.step_fn(self.token, self.cache, self.mask, self.positions)

    def step(self, token: torch.Tensor, mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Replay one draft step for `token` [B, 1] or [1] (device), with a batch's `mask` and `positions`;
        returns the draft's next tokens [B] (a copy)."""
        self.token.copy_(token.view(-1, 1))
        if self.mask is not None:
            self.mask.copy_(mask)
            self.positions.copy_(positions)
        self.graph.replay()
        return self.next_token.reshape(-1).clone()

    def step_token(self, token: torch.Tensor) -> torch.Tensor:
        """Replay one draft step of a single request for `token` [1]; the next token [1, 1] (a copy)."""
        self.token.copy_(token.view(-1, 1))
        self.graph.replay()
        return self.next_token.clone()


def capture_draft_step(model, cache, elb, kv_length: int, mask: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None,
                       compiled: bool = False, workspace=None) -> tuple[DraftStepGraph | None, str]:
    """(graph, status) or (None, reason) when capture is not possible here; the caller then drafts eagerly.
    A batch passes its first step's `mask` and `positions` (their shapes are captured). With `compiled`
    the step is compiled first; if that fails, the plain step is captured and the status says why."""
    if model.device.type != "cuda":
        return None, "no CUDA device"
    if model.rope_on_host:  # a failed capture would leave the CUDA generator unusable
        return None, f"the rotary picks its regime on the host in every step ({model.rope_on_host})"
    compile_problem = ""
    if compiled:
        try:
            return DraftStepGraph(model, cache, elb, kv_length, mask, positions, True, workspace), "on, compiled"
        except Exception as err:  # a compiler error or an op capture rejects in the compiled step
            _undo_warmup(cache, elb, kv_length)
            compile_problem = f", not compiled: {_reason(err)}"
    try:
        return DraftStepGraph(model, cache, elb, kv_length, mask, positions, False, workspace), "on" + compile_problem
    except Exception as err:  # capture rejects host syncs and unsupported ops: fall back, say why
        _undo_warmup(cache, elb, kv_length)
        return None, _reason(err)


def rollback(cache, elb, kv_length: int) -> None:
    """Undo draft steps over a static cache: its length back to `kv_length`, the lookahead counters cleared."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(kv_length)
    elb.clear()


def _undo_warmup(cache, elb, kv_length: int) -> None:
    """After a failed capture: wait for the device, then roll back the warm-up's KV writes and counts."""
    torch.cuda.synchronize()
    rollback(cache, elb, kv_length)


def _reason(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if str(err) else type(err).__name__


@dataclass
class GraphEntry:
    """A static KV cache, the draft step captured over it (None: not yet, or it failed) and why."""

    batch: int | None
    cache: StaticCache
    graph: DraftStepGraph | None = None
    status: str = "off"


class DraftGraphCache:
    """Static KV caches for CUDA-graph drafting and the draft step captured over each, keyed by batch shape.

    Batch `None` is single-request decoding (no mask or position inputs): one cache of at least the asked
    length, kept while requests fit and replaced by a longer one. A batch of B requests: one cache of
    exactly the asked length, replaced when B or the length changes. A replaced cache takes its graph
    with it (the captured addresses changed); a capture that failed is not tried again on the same cache.
    """

    def __init__(self, model, elb, compiled: bool = False, workspace=None) -> None:
        self.model, self.elb, self.compiled = model, elb, compiled  # compiled: torch.compile the step first
        self.workspace = workspace  # the draft kernels' buffers (a MoEWorkspace) every captured step points into
        self._entries: dict[bool, GraphEntry] = {}  # batched? -> its entry

    def static_cache(self, batch: int | None, length: int, min_length: int = 0) -> StaticCache:
        """The cache for `batch` with room for `length` positions (a new one of max(length, min_length)
        positions when the kept one does not fit)."""
        entry = self._entries.get(batch is not None)
        if entry is None or entry.batch != batch or not _fits(entry, length):
            self._entries.pop(batch is not None, None)  # free the old cache and graph first
            entry = GraphEntry(batch, new_static_cache(self.model, max(length, min_length)))
            self._entries[batch is not None] = entry
        return entry.cache

    def side_cache(self, request_cache, length: int, kv_length: int):
        """A single request's KV cache for drafting beside the request (draft-ahead): static with
        the step captured over it where `request_cache` is static (`length` positions at least), else dynamic."""
        if not isinstance(request_cache, StaticCache):
            return DynamicCache(config=self.model.hf.config)
        cache = self.static_cache(None, length, request_cache.max_cache_len)
        self.capture(None, cache, kv_length)
        return cache

    def capture(self, batch: int | None, cache, kv_length: int, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> DraftStepGraph | None:
        """The draft step captured over `cache` (`batch`'s static cache; captured at the first call, a batch
        with its first step's `mask` and `positions`), or None: draft eagerly."""
        entry = self._entry(batch, cache)
        if entry is not None and entry.graph is None and entry.status == "off":
            entry.graph, status = capture_draft_step(self.model, cache, self.elb, kv_length, mask, positions,
                                                     self.compiled, self.workspace)
            entry.status = status if entry.graph is not None else f"failed: {status}"
        return self.graph(batch, cache)

    def graph(self, batch: int | None, cache) -> DraftStepGraph | None:
        """The draft step captured over `cache`, or None."""
        entry = self._entry(batch, cache)
        return None if entry is None else entry.graph

    def status(self, batch: int | None) -> str:
        """"on" ("on, compiled" with torch.compile, "on, not compiled: why" when compiling failed), "off"
        (nothing captured) or "failed: why" for `batch`'s static cache."""
        entry = self._entries.get(batch is not None)
        return "off" if entry is None else entry.status

    def _entry(self, batch: int | None, cache) -> GraphEntry | None:
        entry = self._entries.get(batch is not None)
        return entry if entry is not None and entry.cache is cache else None


def _fits(entry: GraphEntry, length: int) -> bool:
    """A single request's cache fits any length up to its own; a batch's is made for one length."""
    size = entry.cache.max_cache_len
    return size >= length if entry.batch is None else size == length
