"""Whether a system's tokens are the target's: equal, a numeric tie of the run's dtype, or a mismatch (a bug)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specter.speculative.state import StateManager, crop_cache, new_static_cache

EQUAL, TIE, MISMATCH = "equal", "tie", "MISMATCH"


@dataclass(frozen=True)
class TokenCheck:
    """The verdict on one case, and at the first divergence (`position`, 0-based among the new tokens) the
    target's logit gap between its own token and the system's, the dtype's bound on that gap, and the first
    position where the teacher-forced replay of the system's windows disagrees with its tokens (None: it agrees,
    or was not run)."""

    verdict: str
    position: int | None = None
    gap: float | None = None
    bound: float | None = None
    replay: int | None = None

    def text(self) -> str:
        """records.csv's `token_check`: `equal`, `numeric tie (...)` or `MISMATCH (...)`."""
        if self.verdict == EQUAL:
            return EQUAL
        if self.gap is None:
            return f"MISMATCH at token {self.position}"
        if self.replay is not None:
            return (f"MISMATCH at token {self.position} (the replay of its verify windows differs at token "
                    f"{self.replay})")
        if self.verdict == TIE and self.gap > self.bound:
            return (f"numeric tie at token {self.position} (gap {self.gap:.3g}, bound {self.bound:.3g}: the target "
                    f"computed the system's way picks its token)")
        relation = "<=" if self.verdict == TIE else ">"
        name = "numeric tie" if self.verdict == TIE else "MISMATCH"
        return f"{name} at token {self.position} (gap {self.gap:.3g} {relation} bound {self.bound:.3g})"


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` and `reference` differ (a shorter list differs where it ends)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def dtype_bound(one: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> float:
    """How far two logits can move apart by rounding alone: twice the largest difference between the target's
    logits `one` and `other` (the same position computed in two forward shapes), plus one unit in the last place
    of `dtype` at the logits' magnitude (their own rounding)."""
    scale = float(one.abs().max())
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale)) if scale > 0 else 0.0
    return 2 * float((one - other).abs().max()) + ulp


def classify(gap: float, bound: float, shapes_disagree: bool) -> str:
    """A tie when the target itself picks the system's token in another forward shape, or its gap is within the
    dtype's bound; else a mismatch."""
    return TIE if shapes_disagree or gap <= bound else MISMATCH


def target_executor(target):
    """What runs the target-only system's routed experts: its residency manager over its expert cache, reset
    (None: the model's own experts)."""
    session = target.session()
    return None if session is None else session.residency


@torch.inference_mode()
def target_logits(target, ids: torch.Tensor, window: int) -> torch.Tensor:
    """The target's float32 logits [V] at the last position of `ids` [1, T], its last `window` tokens in one
    forward after a prefill of the rest (window 1: target-only's shape; K + 1: a verify pass's)."""
    model = target.model
    split = max(ids.shape[1] - window, 1)
    executor = target_executor(target)
    state = StateManager(model, ids[:, :split])
    state.prefill(executor)
    return model.forward(ids[:, split:].to(model.device), state.cache, "target", executor=executor)[0, -1].float()


@torch.inference_mode()
def incremental_logits(target, ids: torch.Tensor, tokens: list[int], position: int) -> torch.Tensor:
    """The target's float32 logits [V] for new token `position`, computed as target-only computes it: the
    prompt's prefill, then `tokens[:position]` one per forward (dynamic KV)."""
    model = target.model
    executor = target_executor(target)
    state = StateManager(model, ids)
    logits = state.prefill(executor)
    for token in tokens[:position]:
        logits = model.forward(torch.tensor([[token]], device=model.device), state.cache, "target",
                               executor=executor)[0, -1]
    return logits.float()


@torch.inference_mode()
def replay_windows(target, ids: torch.Tensor, tokens: list[int], windows: list, cache_length: int | None = None,
                   at: int | None = None) -> tuple[int | None, torch.Tensor | None]:
    """Teacher-force `tokens` through the target in the system's own verify windows ((k drafted, n accepted) per
    window: the last committed token and the k after it in one forward): (the first position whose argmax is not
    the system's token, None if all agree; the float32 logits [V] of new token `at` there, None if not reached).
    `cache_length`: the system's static KV length (None: dynamic KV)."""
    model = target.model
    executor = target_executor(target)
    cache = None if cache_length is None else new_static_cache(model, cache_length)
    state = StateManager(model, ids, cache)
    first = state.prefill(executor)
    seen = first.float() if at == 0 else None
    if int(first.argmax()) != tokens[0]:
        return 0, seen
    done = 1  # tokens committed so far
    for k, n in windows:
        window = tokens[done - 1: done + k]
        if len(window) < k + 1:
            break
        logits = model.forward(torch.tensor([window], device=model.device), state.cache, "target",
                               executor=executor)[0]  # [k+1, V]
        if at is not None and done <= at <= done + n:
            seen = logits[at - done].float()
        predicted = logits[: n + 1].argmax(dim=-1).tolist()
        for i, (a, b) in enumerate(zip(predicted, tokens[done: done + n + 1])):
            if a != b:
                return done + i, seen
        crop_cache(state.cache, ids.shape[1] + done + n)  # KV of every committed token but the newest
        done += n + 1
    return None, seen


def check_tokens(target, ids: torch.Tensor, tokens: list[int], reference: list[int], k: int,
                 windows: list | None = None, cache_length: int | None = None) -> TokenCheck:
    """`tokens` against target-only's `reference` for prompt `ids` [1, T]. At the first divergence the target's
    logits as target-only computed them are set against the same position computed the system's way: through
    its own verify windows replayed teacher-forced (`windows`; any difference from its tokens there is a bug),
    else in a verify pass's shape (K + 1 tokens after a prefill)."""
    position = first_divergence(tokens, reference)
    if position is None:
        return TokenCheck(EQUAL)
    if position >= min(len(tokens), len(reference)) or getattr(target, "model", None) is None:
        return TokenCheck(MISMATCH, position)  # a different length (never rounding), or no target to ask
    one = incremental_logits(target, ids, reference, position)
    replay, other = replay_windows(target, ids, tokens, windows, cache_length, at=position) if windows else (None, None)
    if other is None:
        prefix = torch.cat([ids, torch.tensor([reference[:position]], dtype=ids.dtype)], dim=1)
        other = target_logits(target, prefix, k + 1)
    mine, theirs = reference[position], tokens[position]
    gap, bound = float(one[mine] - one[theirs]), dtype_bound(one, other, target.model.dtype)
    if replay is not None:
        return TokenCheck(MISMATCH, position, gap, bound, replay)
    return TokenCheck(classify(gap, bound, bool(other[theirs] >= other[mine])), position, gap, bound)
