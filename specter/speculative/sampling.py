"""Speculative acceptance: greedy prefix matching and standard rejection sampling (target-distribution preserving)."""
from __future__ import annotations

import torch

from specter.device.timeline import to_host


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax of logits [..., V] / temperature in float32, with an optional nucleus (top-p) filter."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, config, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token [1] after logits [V]: argmax when `config.greedy`, else a sample at `config.temperature` /
    `config.top_p`, returned with its distribution [V] (speculative sampling needs it)."""
    if config.greedy:
        return logits.argmax(dim=-1, keepdim=True), None
    p = logits_to_probs(logits, config.temperature, config.top_p)
    return sample(p, generator).view(1), p


def seeded_generator(config, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `config.seed` for sampling (None when greedy): the same draws per request."""
    if config.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    return generator


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Longest prefix of draft_tokens [k] equal to the target's argmax.

    Returns (n accepted, tokens to commit: the n accepted drafts and the target's next token).

    target_logits [k+1, V]: position i predicts the token after draft i-1 (position 0 after the input).
    """
    return _accepted_prefix(to_host(draft_tokens), to_host(target_logits.argmax(dim=-1)))


def greedy_accept_batch(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> list[tuple[int, list[int]]]:
    """greedy_accept of every request: draft_tokens [B, k], target_logits [B, k+1, V]; one host read."""
    targets = to_host(target_logits.argmax(dim=-1))  # [B][k+1]
    return [_accepted_prefix(drafts, target) for drafts, target in zip(to_host(draft_tokens), targets)]


def _accepted_prefix(drafts: list[int], target_tokens: list[int]) -> tuple[int, list[int]]:
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    return n, drafts[:n] + [target_tokens[n]]


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Standard speculative sampling (Leviathan et al. 2023); returns (n accepted, tokens to commit).

    draft_tokens [k], draft_probs [k, V], target_probs [k+1, V]. Draft i is accepted with probability
    min(1, p_i(x)/q_i(x)); at the first rejection the next token is drawn from norm(max(0, p - q)); if
    all k are accepted, a bonus token is drawn from p_k.
    """
    k = draft_tokens.shape[0]
    if k == 0:  # nothing drafted (last token of the request): a plain target sample
        return 0, [to_host(sample(target_probs[0], generator))]
    idx = draft_tokens.view(k, 1)
    p = target_probs[:k].gather(1, idx).squeeze(1)  # [k]
    q = draft_probs.gather(1, idx).squeeze(1)  # [k]
    u = torch.rand(k, generator=generator, device=p.device)
    rejected = to_host(u * q > p)  # accept iff u < p / q, without dividing by q
    n = rejected.index(True) if True in rejected else k
    if n == k:
        next_probs = target_probs[k]
    else:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)
        total = residual.sum()
        next_probs = residual / total if to_host(total) > 0 else target_probs[n]
    return n, to_host(draft_tokens[:n]) + [to_host(sample(next_probs, generator))]
