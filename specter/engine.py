"""SpecterEngine.generate: the speculative decode loop (draft K with INT4 experts, verify once, commit)."""
from __future__ import annotations

import torch

from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.models.hybrid_experts import DRAFT, TARGET
from specter.spec.sampling import greedy_accept, logits_to_probs, rejection_accept, sample
from specter.spec.state import StateManager


def check_prompt(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Validate a single-request prompt: LongTensor [1, T] with T >= 1 (a 1-D [T] is accepted too)."""
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise SpecterError(f"input_ids must have shape [1, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise SpecterError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return input_ids.long()


class SpecterEngine:
    """Speculative decoding on one shared-instance hybrid model.

    Each iteration: the draft (INT4 experts) proposes k = min(K, remaining - 1) tokens from the
    committed prefix, the target (full-precision experts) verifies them in one forward over k + 1
    positions, and the state manager commits the accepted prefix plus the correction or bonus token.
    Greedy output equals the target's greedy output; sampling preserves the target distribution.
    """

    name = "specter"

    def __init__(self, model: HybridMoEModel, config: SpecterConfig | None = None) -> None:
        self.model = model
        self.config = config or SpecterConfig(k=model.spec.default_k)
        self.config.check_against(model.num_experts)
        self.generator: torch.Generator | None = None

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32,
                 eos_token_id: int | None = None) -> GenerationResult:
        """New tokens for a [1, T] prompt; stops early only at `eos_token_id` if one is given."""
        input_ids = check_prompt(input_ids, max_new_tokens)
        self._reset_generator()
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids)
        first = self._choose(state.prefill())
        state.commit([first], kv_keep=state.kv_length)
        metrics.commit(1)
        while len(state.generated) < max_new_tokens and not _ended(state.generated, eos_token_id):
            k = min(self.config.k, max_new_tokens - len(state.generated) - 1)
            new_tokens, accepted = self.speculate(state, k, metrics)
            state.commit(new_tokens, kv_keep=state.kv_length + 1 + accepted)
            metrics.commit(len(new_tokens))
            metrics.window(k, accepted)
        tokens = _cut_at_eos(state.generated[:max_new_tokens], eos_token_id)
        return GenerationResult(tokens, metrics.summary())

    def speculate(self, state: StateManager, k: int, metrics: DecodeMetrics) -> tuple[list[int], int]:
        """One iteration: draft k tokens, verify k + 1 positions; returns (tokens to commit, n accepted)."""
        metrics.begin("draft")
        drafts, draft_probs = self.draft(state, k)
        metrics.end("draft")
        metrics.begin("verify")
        verify_input = torch.cat([state.uncached(), drafts.view(1, -1)], dim=1)  # [1, k+1]
        target_logits = self.model.forward(verify_input, state.cache, TARGET)[0]  # [k+1, V]
        if self.config.greedy:
            accepted, new_tokens = greedy_accept(drafts, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, self.config.temperature, self.config.top_p)
            accepted, new_tokens = rejection_accept(drafts, draft_probs, target_probs, self.generator)
        metrics.end("verify")
        return new_tokens, accepted

    def draft(self, state: StateManager, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens [k] (and their distributions [k, V] when sampling); tokens stay on the device."""
        tokens, probs = [], []
        x = state.uncached()
        with state.draft_scratch():
            for _ in range(k):
                logits = self.model.forward(x, state.cache, DRAFT)[0, -1]  # [V]
                if self.config.greedy:
                    token = logits.argmax(dim=-1, keepdim=True)  # [1]
                else:
                    p = logits_to_probs(logits, self.config.temperature, self.config.top_p)
                    token = sample(p, self.generator).view(1)
                    probs.append(p)
                tokens.append(token)
                x = token.view(1, 1)
        empty = torch.empty(0, dtype=torch.long, device=self.model.device)
        drafted = torch.cat(tokens) if tokens else empty
        return drafted, (torch.stack(probs) if probs else None)

    def _choose(self, logits: torch.Tensor) -> int:
        """The target's token from one position's logits [V] (argmax or a sample)."""
        if self.config.greedy:
            return int(logits.argmax())
        return int(sample(logits_to_probs(logits, self.config.temperature, self.config.top_p), self.generator))

    def _reset_generator(self) -> None:
        if not self.config.greedy:
            self.generator = torch.Generator(device=self.model.device)
            self.generator.manual_seed(self.config.seed)


def _ended(tokens: list[int], eos: int | None) -> bool:
    return eos is not None and eos in tokens


def _cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens
