"""Speculative sampling preserves the target distribution (statistical tests with stated tolerances)."""
import dataclasses

import pytest
import torch
from transformers import DynamicCache

import specter
from specter.speculative.sampling import logits_to_probs, rejection_accept
from tests.conftest import prompt, tiny_model

SIGMAS = 4.5  # an empirical frequency may be off by at most 4.5 standard errors (per token)


def within_tolerance(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """True if every token's empirical frequency is within SIGMAS standard errors of probs."""
    n = samples.numel()
    freq = torch.bincount(samples, minlength=probs.numel()).double() / n
    stderr = (probs.double() * (1 - probs.double()) / n).sqrt()
    return bool(torch.all((freq - probs.double()).abs() <= SIGMAS * stderr + 1.0 / n))


TARGET = torch.tensor([[0.50, 0.30, 0.15, 0.05], [0.10, 0.20, 0.30, 0.40], [0.25, 0.25, 0.25, 0.25]])
DRAFT = torch.tensor([[0.10, 0.20, 0.30, 0.40], [0.40, 0.30, 0.20, 0.10]])


def run_windows(trials: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Committed tokens of `trials` windows of k=2 with the fixed rows above."""
    gen = torch.Generator().manual_seed(seed)
    firsts, seconds, lengths = [], [], []
    for _ in range(trials):
        drafts = torch.stack([torch.multinomial(DRAFT[i], 1, generator=gen)[0] for i in range(2)])
        n, tokens = rejection_accept(drafts, DRAFT, TARGET, gen)
        assert len(tokens) == n + 1 and tokens[:n] == drafts[:n].tolist()
        firsts.append(tokens[0])
        lengths.append(len(tokens))
        if len(tokens) >= 2:
            seconds.append(tokens[1])
    return torch.tensor(firsts), torch.tensor(seconds), lengths


def test_rejection_sampling_preserves_target_rows():
    firsts, seconds, lengths = run_windows(20000)
    assert within_tolerance(firsts, TARGET[0])  # first committed token ~ p0, whatever the draft proposed
    assert within_tolerance(seconds, TARGET[1])  # second (accepted draft or residual sample) ~ p1
    assert 3 in lengths  # bonus tokens happen


def test_tolerance_has_power():
    """The same check rejects the draft's own distribution, so the test above can fail."""
    firsts, _, _ = run_windows(20000)
    assert not within_tolerance(firsts, DRAFT[0])


def test_logits_to_probs_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, temperature=1.0, top_p=0.7)
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.slow
def test_engine_sampling_matches_target_marginal():
    """End to end on a tiny model: the 2nd generated token's marginal equals the target's exact marginal."""
    model, temperature, trials = tiny_model("tiny-mixtral"), 0.5, 1500
    ids = prompt("Q:")
    with torch.inference_mode():
        p0 = logits_to_probs(model.forward(ids, DynamicCache(config=model.hf.config))[0, -1], temperature, top_p=1.0)
        firsts = torch.arange(p0.numel())
        batch = torch.cat([ids.expand(len(firsts), -1), firsts.view(-1, 1)], dim=1)  # [V, T+1]
        p1 = logits_to_probs(model.forward(batch, DynamicCache(config=model.hf.config))[:, -1], temperature, top_p=1.0)
    marginal = (p0.view(-1, 1) * p1).sum(0)  # [V]
    engine = specter.SpecterEngine(model, specter.SpecterConfig(k=2, temperature=temperature))
    seconds = []
    for seed in range(trials):
        engine.config = dataclasses.replace(engine.config, seed=seed)  # the resolved config, reseeded
        seconds.append(engine.generate(ids, max_new_tokens=3).token_ids[1])  # a k=1 window
    assert within_tolerance(torch.tensor(seconds), marginal)
    assert not within_tolerance(torch.tensor(seconds), torch.full_like(marginal, 1 / marginal.numel()))
