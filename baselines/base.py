"""The contract every compared system follows: available() and generate(input_ids, max_new_tokens)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specter.metrics import GenerationResult


@runtime_checkable
class System(Protocol):
    """A decoding system under comparison (Specter itself, a reference, or a baseline); the harness checks every
    system it builds against it (`experiments.systems.build_system`)."""

    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") if it can run here, else (False, reason); a result row then says 'unavailable: reason'."""

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> GenerationResult:
        """New tokens only, plus the same stats keys as Specter's (tpot_ms, ttft_ms, ...)."""
