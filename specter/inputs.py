"""Input checks shared by every system's generate(): one prompt, or a batch of prompts."""
from __future__ import annotations

import torch

from specter.errors import SpecterError


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


def is_batch(input_ids) -> bool:
    """A list or tuple of prompts (each a token list or a tensor), as opposed to one prompt."""
    return isinstance(input_ids, (list, tuple)) and any(isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids)


def check_batch(prompts, max_new_tokens: int) -> list[torch.Tensor]:
    """Each prompt of a batch as a [1, T] LongTensor (token lists or tensors); at least one."""
    if len(prompts) == 0:
        raise SpecterError("a batch needs at least one prompt")
    return [check_prompt(torch.as_tensor(p, dtype=torch.long), max_new_tokens) for p in prompts]
