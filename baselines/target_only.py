"""Target-only reference: plain autoregressive decoding of the full-precision target, one token per step."""
from __future__ import annotations

import torch

from specter.engine import check_prompt
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.offload.runtime import offload_experts
from specter.spec.state import StateManager


class TargetOnly:
    """Greedy decoding with the target experts only, on the same model object and KV state machinery.

    With `resident_experts_per_layer`, the experts come through the same expert cache and residency
    manager as Specter's, loaded on demand (the "target-only, same cache, no speculation" reference).
    """

    name = "target_only"

    def __init__(self, model: HybridMoEModel, resident_experts_per_layer: int | None = None) -> None:
        self.model = model
        self.slots = resident_experts_per_layer
        self.runtime = self._attach()

    def _attach(self):
        """On-demand offload with the given cache (no speculation, no prefetch), or all experts resident."""
        return None if self.slots is None else offload_experts(self.model, self.slots)

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult:
        input_ids = check_prompt(input_ids, max_new_tokens)
        if self.runtime is not None:
            self.runtime = self._attach()  # another system may have switched the model's cache
            self.runtime.reset()
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids)
        next_token = state.prefill().argmax(dim=-1, keepdim=True)  # [1], stays on the device
        while True:
            state.commit(next_token.tolist(), kv_keep=len(state.tokens))  # the tokens committed before this one have KV
            metrics.commit(1)
            if len(state.generated) == max_new_tokens:
                break
            logits = self.model.forward(state.uncached(), state.cache, "target")[0, -1]
            next_token = logits.argmax(dim=-1, keepdim=True)
        stats = metrics.summary()
        if self.runtime is not None:
            stats.update(self.runtime.stats())
            stats["h2d_bytes_per_token"] = stats["h2d_bytes"] / max(stats["generated_tokens"], 1)
        return GenerationResult(state.generated, stats)
