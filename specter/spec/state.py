"""State manager: the authoritative token sequence and the target KV cache, with commit and rollback."""
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch
from transformers import DynamicCache


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Drop KV entries past `keep` (negative-count form: portable across transformers 5.x)."""
    excess = cache.get_seq_length() - keep
    if excess > 0:
        cache.crop(-excess)


class StateManager:
    """Committed tokens plus the KV of all but the last committed token (the one uncached input).

    Speculative work extends the same cache temporarily: the draft writes a scratch extension that
    `draft_scratch()` discards; verification writes target entries of which `commit` keeps only those
    of accepted tokens.
    """

    def __init__(self, model, prompt: torch.Tensor) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.hf.config)
        self.tokens: list[int] = prompt[0].tolist()
        self.prompt_length = len(self.tokens)
        self._device_tokens = prompt.to(model.device)  # [1, T]
        self.kv_length = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    def uncached(self) -> torch.Tensor:
        """Input ids [1, n] of committed tokens without KV (one token after the first commit)."""
        return self._device_tokens[:, self.kv_length:]

    def prefill(self) -> torch.Tensor:
        """Target forward over the prompt; returns the last position's logits [V]."""
        logits = self.model.forward(self.uncached(), self.cache, "target")
        self.kv_length = self.cache.get_seq_length()
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
