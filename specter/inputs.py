"""Input checks shared by every system's generate(): one prompt, or a batch of prompts."""
from __future__ import annotations

import torch

from specter.errors import SpecterError


def check_prompt(input_ids, max_new_tokens: int, vocab_size: int | None = None,
                 max_positions: int | None = None) -> torch.Tensor:
    """Validate a single-request prompt: integer token ids [1, T] with T >= 1 (a 1-D [T] is accepted too),
    each in [0, vocab_size), with T + max_new_tokens <= max_positions (the model's context); returned as a
    LongTensor."""
    if not isinstance(input_ids, torch.Tensor):
        try:
            input_ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as err:
            raise SpecterError(f"input_ids must be token ids (integers), got {type(input_ids).__name__}: {err}") from None
    if input_ids.numel() == 0:  # [] converts to an empty float tensor: refused by its shape below
        input_ids = input_ids.long()
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise SpecterError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype} (tokenize the text "
                           f"first, e.g. model.tokenizer(text)['input_ids'])")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise SpecterError(f"input_ids must have shape [1, T] with T >= 1, got {tuple(input_ids.shape)}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise SpecterError(f"input_ids holds token id {bad}, outside this model's vocabulary [0, {vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecterError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_context(input_ids.shape[1], max_new_tokens, max_positions)
    return input_ids.long()


def check_context(length: int, max_new_tokens: int, max_positions: int | None) -> None:
    """One-line error when a prompt of `length` tokens and its new tokens do not fit the model's context."""
    if max_positions is not None and length + max_new_tokens > max_positions:
        raise SpecterError(f"the prompt is {length} tokens and max_new_tokens {max_new_tokens}; this model's context "
                           f"holds {max_positions} positions: shorten the prompt or lower max_new_tokens")


def is_batch(input_ids) -> bool:
    """A list or tuple of prompts (each a token list or a tensor), as opposed to one prompt."""
    return isinstance(input_ids, (list, tuple)) and any(isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids)


def check_batch(prompts, max_new_tokens: int, vocab_size: int | None = None,
                max_positions: int | None = None) -> list[torch.Tensor]:
    """Each prompt of a batch as a [1, T] LongTensor (token lists or tensors), checked as check_prompt does; at
    least one."""
    if len(prompts) == 0:
        raise SpecterError("a batch needs at least one prompt")
    return [check_prompt(p, max_new_tokens, vocab_size, max_positions) for p in prompts]
