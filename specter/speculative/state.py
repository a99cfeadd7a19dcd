"""State manager: the authoritative token sequence and the target KV cache, with commit and rollback."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache, StaticCache

from specter.models.device_rope import rope_switch


def crop_cache(cache, keep: int) -> None:
    """Drop KV entries past `keep`.

    DynamicCache: the negative-count crop (portable across transformers 5.x). StaticCache: move each
    layer's device-side length back (no host sync); entries past it are masked, then overwritten.
    """
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(keep)
        return
    excess = cache.get_seq_length() - keep
    if excess > 0:
        cache.crop(-excess)


def copy_rows(dst, src, rows: int, length: int) -> None:
    """`dst` holds `src`'s first `rows` KV positions, then its own positions up to `length` (two caches of one
    model, both static or both dynamic; no host sync)."""
    for dst_layer, src_layer in zip(dst.layers, src.layers):
        if not src_layer.is_initialized:
            continue
        if isinstance(dst, StaticCache):
            if dst_layer.is_initialized:
                dst_layer.keys[:, :, :rows].copy_(src_layer.keys[:, :, :rows])
                dst_layer.values[:, :, :rows].copy_(src_layer.values[:, :, :rows])
                dst_layer.cumulative_length.fill_(length)
            continue
        if not dst_layer.is_initialized:
            dst_layer.lazy_initialization(src_layer.keys, src_layer.values)
        keep = dst_layer.get_seq_length() >= length > rows  # its own rows past the copied ones
        keys, values = src_layer.keys[:, :, :rows], src_layer.values[:, :, :rows]
        dst_layer.keys = torch.cat([keys, dst_layer.keys[:, :, rows:length]], dim=-2) if keep else keys.clone()
        dst_layer.values = torch.cat([values, dst_layer.values[:, :, rows:length]], dim=-2) if keep else values.clone()


def window_length(k: int, kv_length: int, switch: int | None) -> int:
    """How many tokens a window starting at `kv_length` cached positions may draft: k, or fewer so that no
    forward spans a longrope model's `switch` (HF computes positions before it with the short regime); 0 at
    the switch itself (the next forward recomputes the whole sequence, see StateManager.window)."""
    if switch is None or kv_length > switch:
        return k
    if kv_length == switch:
        return 0
    return min(k, switch - 1 - kv_length)


def new_static_cache(model, max_length: int) -> StaticCache:
    """A preallocated KV cache of `max_length` positions (fixed addresses: CUDA-graph safe)."""
    return StaticCache(config=model.hf.config, max_cache_len=max_length)


class StateManager:
    """Committed tokens plus the KV of all but the last committed token (the one uncached input).

    Speculative work extends the same cache temporarily: the draft writes a scratch extension that
    `draft_scratch()` discards; verification writes target entries of which `commit` keeps only those
    of accepted tokens.
    """

    def __init__(self, model, prompt: torch.Tensor, cache=None) -> None:
        """`cache`: an empty StaticCache to reuse (the engine's, on CUDA), else a new DynamicCache."""
        self.model = model
        self.cache = cache if cache is not None else DynamicCache(config=model.hf.config)
        crop_cache(self.cache, 0)
        self.tokens: list[int] = prompt[0].tolist()
        self.prompt_length = len(self.tokens)
        self._device_tokens = prompt.to(model.device)  # [1, T]
        self.kv_length = 0
        self.switch = rope_switch(model.hf.config)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    def uncached(self) -> torch.Tensor:
        """Input ids [1, n] of committed tokens without KV (one token after the first commit)."""
        return self._device_tokens[:, self.kv_length:]

    @property
    def uncached_length(self) -> int:
        return self._device_tokens.shape[1] - self.kv_length

    def window(self, k: int) -> int:
        """How many tokens the next window may draft (`window_length`). At a longrope model's switch the cache
        is dropped and 0 returned: the next forward recomputes the whole sequence, as HF does."""
        if self.switch is not None and self.kv_length == self.switch:
            crop_cache(self.cache, 0)
            self.kv_length = 0
            return 0
        return window_length(k, self.kv_length, self.switch)

    def prefill(self, executor=None) -> torch.Tensor:
        """Target forward over the prompt (routed experts through `executor`; None: the model's own); returns the
        last position's logits [V]."""
        logits = self.model.forward(self.uncached(), self.cache, "target", executor=executor)
        self.kv_length = self.prompt_length
        return logits[0, -1]

    @contextmanager
    def draft_scratch(self) -> Iterator[None]:
        """Let the draft extend the cache; afterwards crop back to the committed boundary."""
        try:
            yield
        finally:
            crop_cache(self.cache, self.kv_length)

    def commit(self, new_tokens: list[int], kv_keep: int) -> None:
        """Append accepted tokens (+ correction/bonus); keep target KV only up to `kv_keep` positions."""
        self.tokens.extend(new_tokens)
        crop_cache(self.cache, kv_keep)
        self.kv_length = kv_keep
        added = torch.tensor([new_tokens], dtype=torch.long, device=self._device_tokens.device)
        self._device_tokens = torch.cat([self._device_tokens, added], dim=1)
