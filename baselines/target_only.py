"""Target-only reference: plain autoregressive decoding of the full-precision target, one token per step."""
from __future__ import annotations

import torch

from specter.engine import check_prompt
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.spec.state import StateManager


class TargetOnly:
    """Greedy decoding with the target experts only, on the same model object and KV state machinery."""

    name = "target_only"

    def __init__(self, model: HybridMoEModel) -> None:
        self.model = model

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult:
        input_ids = check_prompt(input_ids, max_new_tokens)
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids)
        next_token = state.prefill().argmax(dim=-1, keepdim=True)  # [1], stays on the device
        while True:
            state.commit(next_token.tolist(), kv_keep=state.cache.get_seq_length())
            metrics.commit(1)
            if len(state.generated) == max_new_tokens:
                break
            logits = self.model.forward(state.uncached(), state.cache, "target")[0, -1]
            next_token = logits.argmax(dim=-1, keepdim=True)
        return GenerationResult(state.generated, metrics.summary())
