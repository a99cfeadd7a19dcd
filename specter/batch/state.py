"""Batched decoding state: one KV cache for B requests, each with its own tokens, positions and holes."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from specter.errors import SpecterError
from specter.models.hybrid_experts import TARGET
from specter.speculative.state import crop_cache, rope_switch


def refuse_rope_switch(model, prompts: list, max_new_tokens: int) -> None:
    """Batched decoding keeps one cache for all requests, so it cannot recompute one request's cache at
    a longrope switch (see StateManager.window): a batch that would reach it is a one-line error."""
    switch = rope_switch(model.hf.config)
    longest = max(p.shape[-1] for p in prompts)  # each [1, T]
    if switch is not None and longest + max_new_tokens > switch:
        raise SpecterError(f"batched decoding reaches position {longest + max_new_tokens}, past this longrope "
                           f"model's switch at {switch}: decode these requests one at a time")


def fill_static(cache: StaticCache, merged: DynamicCache) -> bool:
    """Copy a batch's cache into an empty StaticCache of the same batch (fixed addresses: graph-safe);
    False when a layer is not a plain static layer (sliding windows) or the cache is too short."""
    width = merged.get_seq_length()
    if any(type(layer) is not StaticLayer for layer in cache.layers) or width > cache.max_cache_len:
        return False
    for static, layer in zip(cache.layers, merged.layers):
        if not static.is_initialized or static.keys.shape[0] != layer.keys.shape[0]:
            static.lazy_initialization(layer.keys, layer.values)
        static.keys[:, :, :width].copy_(layer.keys)
        static.values[:, :, :width].copy_(layer.values)
        static.cumulative_length.fill_(width)
    return True


class BatchState:
    """Committed tokens and KV of B requests in one cache, filled by one left-padded prefill.

    Column j of the cache holds, for every request, one KV entry or a hole. The mask [B, S] marks each
    request's own entries (1) against holes (0): the left padding of shorter prompts and the positions
    a request rejected in a verify pass that other requests accepted. Each request keeps its own
    position count (`lengths`), so its RoPE positions and its attention are those of decoding alone.
    Drafting extends all requests by the same columns and is cropped afterwards; verification appends
    k + 1 columns of which each request keeps its accepted prefix.

    With `static` (an empty StaticCache, CUDA-graph decoding) the cache has fixed addresses and a fixed
    width: masks are 4D [B, 1, T, max_len] additive biases built here, and when the columns would run out
    the cache is compacted (each request's own entries packed to the right, holes dropped).
    """

    def __init__(self, model, prompts: list[torch.Tensor], static: StaticCache | None = None) -> None:
        self.model, self.device, self.static = model, model.device, static
        self.tokens: list[list[int]] = [p[0].tolist() for p in prompts]
        self.prompt_lengths = [len(t) for t in self.tokens]
        self.lengths = list(self.prompt_lengths)  # KV entries of each request = its next position
        self.cache: DynamicCache | None = None
        self.mask = torch.empty(0)
        self.last = self.next_positions = torch.empty(0)

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    def generated(self, request: int) -> list[int]:
        return self.tokens[request][self.prompt_lengths[request]:]

    def prefill(self, executor=None) -> torch.Tensor:
        """All prompts in one target forward, left-padded (each expert is loaded once for the whole batch,
        not once per request; through `executor`, None: the model's own); returns the last position's logits
        [B, V]."""
        width = max(self.prompt_lengths)
        ids = torch.zeros(self.batch_size, width, dtype=torch.long, device=self.device)  # [B, width]
        self.mask = torch.zeros(self.batch_size, width, dtype=torch.long, device=self.device)
        for request, tokens in enumerate(self.tokens):
            ids[request, width - len(tokens):] = torch.tensor(tokens, device=self.device)
            self.mask[request, width - len(tokens):] = 1
        positions = (self.mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, width]: each request from 0
        self.cache = DynamicCache(config=self.model.hf.config)
        bias = self._bias_4d(self.mask, width, width)  # padding rows see only themselves: never all masked
        logits = self.model.forward(ids, self.cache, TARGET, bias, positions, executor)[:, -1]  # [B, V]
        if self.static is not None and fill_static(self.static, self.cache):
            self.cache = self.static
        else:
            self.static = None
        return logits

    def step_inputs(self, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask, position_ids [B, length]) for `length` new columns after `offset` scratch
        columns (draft steps) past the committed width S. The mask is [B, S + offset + length] (0 = hole),
        or with a static cache the 4D additive bias [B, 1, length, max_len] (holes, causal order and the
        unwritten columns masked)."""
        ones = torch.ones(self.batch_size, offset + length, dtype=torch.long, device=self.device)
        keep = torch.cat([self.mask, ones], dim=1)  # [B, S + offset + length]
        positions = self.next_positions + offset + torch.arange(length, device=self.device)  # [B, length]
        if self.static is None:
            return keep, positions
        return self._bias_4d(keep, length, self.static.max_cache_len), positions

    def _bias_4d(self, keep: torch.Tensor, length: int, width: int) -> torch.Tensor:
        """Additive mask [B, 1, length, width] for the last `length` of the kept columns: query t sees the
        kept columns up to its own column, and always its own column (so no row is fully masked)."""
        total = keep.shape[1]
        keep = F.pad(keep, (0, width - total))  # [B, width]
        query_column = total - length + torch.arange(length, device=self.device)  # [length]
        column = torch.arange(width, device=self.device).unsqueeze(0)  # [1, width]
        causal = column <= query_column.unsqueeze(1)  # [length, width]
        own = column == query_column.unsqueeze(1)  # [length, width]
        allowed = (keep.bool().unsqueeze(1) & causal.unsqueeze(0)) | own.unsqueeze(0)  # [B, length, width]
        bias = torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device)
        return bias.masked_fill_(~allowed, torch.finfo(self.model.dtype).min).unsqueeze(1)

    def make_room(self, columns: int) -> None:
        """Ensure `columns` more columns fit the static cache: compact it if they would not."""
        if self.static is None or self.mask.shape[1] + columns <= self.static.max_cache_len:
            return
        width = max(self.lengths)
        if width + columns > self.static.max_cache_len:
            raise ValueError(f"static batch cache of {self.static.max_cache_len} positions is too short for "
                             f"{width + columns}")
        packed, order = torch.sort(self.mask, dim=1, stable=True)  # holes first, then each request's own
        order = order[:, -width:]  # [B, width]
        for layer in self.static.layers:
            for data in (layer.keys, layer.values):  # [B, H, max_len, D]
                index = order[:, None, :, None].expand(-1, data.shape[1], -1, data.shape[3])
                data[:, :, :width].copy_(torch.gather(data, 2, index))
            layer.cumulative_length.fill_(width)
        self.mask = packed[:, -width:]

    @contextmanager
    def draft_scratch(self) -> Iterator[None]:
        """Let the draft extend every request; afterwards crop back to the committed width."""
        try:
            yield
        finally:
            crop_cache(self.cache, self.mask.shape[1])

    def commit(self, new_tokens: list[list[int]], accepted: list[int]) -> None:
        """After a verify pass over k + 1 columns: request r keeps the KV of its input and its accepted
        drafts (1 + accepted[r] columns; the rest become holes) and appends new_tokens[r]. A request
        that is done passes accepted -1 and no tokens: it keeps nothing."""
        columns = int(self.cache.get_seq_length()) - self.mask.shape[1]  # k + 1
        keep = torch.arange(columns, device=self.device).unsqueeze(0) <= torch.tensor(
            accepted, device=self.device).unsqueeze(1)  # [B, k+1]
        self.mask = torch.cat([self.mask, keep.long()], dim=1)
        for request, tokens in enumerate(new_tokens):
            self.tokens[request].extend(tokens)
            self.lengths[request] += 1 + accepted[request]
        self._set_last()

    def commit_first(self, tokens: list[int]) -> None:
        """The prefill's next token of each request (no KV yet: the next pass's input)."""
        for request, token in enumerate(tokens):
            self.tokens[request].append(token)
        self._set_last()

    def _set_last(self) -> None:
        """The next pass's inputs on the device, copied once per pass (a per-step host tensor would make
        every draft step wait for the previous one)."""
        self.last = torch.tensor([[t[-1]] for t in self.tokens], dtype=torch.long, device=self.device)  # [B, 1]
        self.next_positions = torch.tensor(self.lengths, device=self.device).unsqueeze(1)  # [B, 1]
