"""One target pass over a window's drafts and the acceptance rule: how many drafts stand, which tokens to commit."""
from __future__ import annotations

import torch

from specter.models.hybrid_experts import TARGET
from specter.speculative.sampling import greedy_accept, greedy_accept_batch, logits_to_probs, rejection_accept


def verify_and_accept(model, state, drafts: torch.Tensor, draft_probs: torch.Tensor | None, config,
                      generator: torch.Generator | None, executor=None) -> tuple[int, list[int]]:
    """Target forward over [uncached, d1..dk] of one request (`state`: a speculative.state.StateManager), its
    routed experts through `executor` (the window's; None: the model's own); then the longest greedy prefix
    (`config.greedy`) or rejection sampling at `config.temperature` / `config.top_p`.
    drafts [k], draft_probs [k, V] when sampling; returns (n accepted, tokens to commit)."""
    k = drafts.shape[0]
    verify_input = torch.cat([state.uncached(), drafts.view(1, -1)], dim=1)  # [1, u+k], u = 1 but at a rope switch
    target_logits = model.forward(verify_input, state.cache, TARGET, executor=executor)[0, -(k + 1):]  # [k+1, V]
    if config.greedy:
        return greedy_accept(drafts, target_logits)
    target_probs = logits_to_probs(target_logits, config.temperature, config.top_p)
    return rejection_accept(drafts, draft_probs, target_probs, generator)


def verify_batch(model, state, drafts: torch.Tensor, executor=None) -> list[tuple[int, list[int]]]:
    """Target forward over [last, drafts] of every request of `state` (a batch.state.BatchState), its routed
    experts through `executor` (the window's; None: the model's own), greedy; drafts [B, k]; (n accepted, tokens
    to commit) per request."""
    mask, positions = state.step_inputs(offset=0, length=drafts.shape[1] + 1)
    verify_input = torch.cat([state.last, drafts], dim=1)  # [B, k+1]
    logits = model.forward(verify_input, state.cache, TARGET, mask, positions, executor)  # [B, k+1, V]
    return greedy_accept_batch(drafts, logits)
