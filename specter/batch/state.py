"""Batched decoding state: one KV cache for B requests, each with its own tokens, positions and holes."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specter.models.hybrid_experts import TARGET
from specter.spec.state import crop_cache


def merge_left_padded(caches: list[DynamicCache], length: int, config) -> DynamicCache:
    """One cache of batch B from B single-request caches, each left-padded with zeros to `length`.

    Zero keys and values (never NaN) at masked positions contribute exactly nothing to attention.
    """
    data = []
    for layer in range(len(caches[0].layers)):
        keys, values = [], []
        for cache in caches:
            k, v = cache.layers[layer].keys, cache.layers[layer].values  # [1, H, L, D]
            pad = (0, 0, length - k.shape[-2], 0)  # left of the sequence dim
            keys.append(F.pad(k, pad))
            values.append(F.pad(v, pad))
        data.append((torch.cat(keys), torch.cat(values)))  # [B, H, length, D]
    return DynamicCache(ddp_cache_data=data, config=config)


class BatchState:
    """Committed tokens and KV of B requests in one cache.

    Column j of the cache holds, for every request, one KV entry or a hole. The mask [B, S] marks each
    request's own entries (1) against holes (0): the left padding of shorter prompts and the positions
    a request rejected in a verify pass that other requests accepted. Each request keeps its own
    position count (`lengths`), so its RoPE positions and its attention are those of decoding alone.
    Drafting extends all requests by the same columns and is cropped afterwards; verification appends
    k + 1 columns of which each request keeps its accepted prefix.
    """

    def __init__(self, model, prompts: list[torch.Tensor]) -> None:
        self.model, self.device = model, model.device
        self.tokens: list[list[int]] = [p[0].tolist() for p in prompts]
        self.prompt_lengths = [len(t) for t in self.tokens]
        self.lengths = list(self.prompt_lengths)  # KV entries of each request = its next position
        self.cache: DynamicCache | None = None
        self.mask = torch.empty(0)
        self.last = torch.empty(0)

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    def generated(self, request: int) -> list[int]:
        return self.tokens[request][self.prompt_lengths[request]:]

    def prefill(self) -> torch.Tensor:
        """Each prompt alone through the target (its unbatched prefill exactly), then one left-padded
        cache; returns the last position's logits [B, V]."""
        caches, logits = [], []
        for tokens in self.tokens:
            cache = DynamicCache(config=self.model.hf.config)
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T_r]
            logits.append(self.model.forward(ids, cache, TARGET)[0, -1])
            caches.append(cache)
        width = max(self.prompt_lengths)
        self.cache = merge_left_padded(caches, width, self.model.hf.config)
        self.mask = torch.zeros(self.batch_size, width, dtype=torch.long, device=self.device)
        for request, length in enumerate(self.prompt_lengths):
            self.mask[request, width - length:] = 1
        return torch.stack(logits)

    def step_inputs(self, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask [B, S + offset + length], position_ids [B, length]) for `length` new columns
        after `offset` scratch columns (draft steps) past the committed width S."""
        ones = torch.ones(self.batch_size, offset + length, dtype=torch.long, device=self.device)
        start = torch.tensor(self.lengths, device=self.device).unsqueeze(1) + offset  # [B, 1]
        return torch.cat([self.mask, ones], dim=1), start + torch.arange(length, device=self.device)

    @contextmanager
    def draft_scratch(self) -> Iterator[None]:
        """Let the draft extend every request; afterwards crop back to the committed width."""
        try:
            yield
        finally:
            crop_cache(self.cache, self.mask.shape[1])

    def commit(self, new_tokens: list[list[int]], accepted: list[int]) -> None:
        """After a verify pass over k + 1 columns: request r keeps the KV of its input and its accepted
        drafts (1 + accepted[r] columns; the rest become holes) and appends new_tokens[r]."""
        columns = self.cache.get_seq_length() - self.mask.shape[1]  # k + 1
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
        self.last = torch.tensor([[t[-1]] for t in self.tokens], dtype=torch.long, device=self.device)  # [B, 1]
