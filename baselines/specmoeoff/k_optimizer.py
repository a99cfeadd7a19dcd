"""SpecMoEOff's speculation depth: a roofline-style window cost model over running averages, minimised per token."""
from __future__ import annotations

from dataclasses import dataclass, field

STEADY_VARIANCE = 0.25  # below this spread of verified-token counts the pass/token split is not re-fitted


@dataclass
class Window:
    """One speculative iteration as measured: k drafted, n accepted, tokens committed, wall ms, draft ms/step,
    experts loaded."""

    k: int
    accepted: int
    tokens: list[int]
    ms: float
    draft_ms: float | None
    loads: int = 0


def expected_tokens(alpha: float, k: int) -> float:
    """Committed tokens per window of k drafts (accepted + the correction/bonus): (1 - a^(k+1)) / (1 - a)."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_distinct(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts one layer routes `tokens` tokens to (top_k of `experts` each, uniform)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass
class CostModel:
    """Cost of a window of K drafts: K draft steps, one target pass, token-wise expert compute per verified
    token, and the loads of the window's expected distinct experts at the measured H2D time per expert.

    All but the model shape are running averages (weight `weight` on the newest observation) starting from
    the defaults. The verify compute c(n) = pass + n * token is fitted over (n, c) observations, the
    prefill (n = prompt length) and the windows (n = K + 1).
    """

    layers: int
    experts: int
    top_k: int
    alpha: float = 0.8  # per-token acceptance
    draft_ms: float = 5.0  # one draft step
    verify_pass_ms: float = 10.0  # one target pass besides the routed experts
    verify_token_ms: float = 1.0  # one verified token's expert GEMVs (token-wise)
    load_ms: float = 0.7  # one FP expert over the H2D link
    load_factor: float = 0.5  # loads per expected distinct expert (< 1: cache hits; > 1: slots cycle in a window)
    weight: float = 0.3
    _fit: list | None = field(default=None, repr=False)  # running means of n, c, n*n, n*c

    def loads(self, k: int) -> float:
        return self.layers * self.load_factor * expected_distinct(k + 1, self.experts, self.top_k)

    def window_ms(self, k: int) -> float:
        return k * self.draft_ms + self.verify_pass_ms + (k + 1) * self.verify_token_ms + self.loads(k) * self.load_ms

    def observe(self, k: int, accepted: int, window_ms: float, loads: int,
                draft_ms: float | None = None, load_ms: float | None = None) -> None:
        """Fold in one window: k drafted, `accepted` of them accepted, its wall time and expert loads; the
        draft's ms per step and one expert's load time where they were measured."""
        if k < 1:
            return
        checked = accepted + 1 if accepted < k else k
        self._update("alpha", accepted / checked)
        if draft_ms is not None:
            self._update("draft_ms", draft_ms)
        if load_ms is not None:
            self._update("load_ms", load_ms)
        self._update("load_factor", loads / (self.layers * expected_distinct(k + 1, self.experts, self.top_k)))
        self.observe_verify(k + 1, window_ms - k * self.draft_ms, loads)

    def observe_verify(self, tokens: int, ms: float, loads: int) -> None:
        """One target pass over `tokens` tokens that took `ms` with `loads` expert loads: refit pass + token."""
        compute = ms - loads * self.load_ms
        values = (tokens, compute, tokens * tokens, tokens * compute)
        old = self._fit or values
        self._fit = [m + self.weight * (v - m) for m, v in zip(old, values, strict=True)]
        n, c, nn, nc = self._fit
        if nn - n * n > STEADY_VARIANCE:
            self.verify_token_ms = max((nc - n * c) / (nn - n * n), 0.0)
        self.verify_pass_ms = max(c - self.verify_token_ms * n, 0.0)

    def _update(self, name: str, value: float) -> None:
        old = getattr(self, name)
        setattr(self, name, old + self.weight * (value - old))

    def as_dict(self) -> dict:
        names = ("alpha", "draft_ms", "verify_pass_ms", "verify_token_ms", "load_ms", "load_factor")
        return {name: getattr(self, name) for name in names}


def time_per_token(costs: CostModel, k: int) -> float:
    """Expected ms per committed token with k drafts per window."""
    return costs.window_ms(k) / expected_tokens(costs.alpha, k)


def best_k(costs: CostModel, k_max: int) -> int:
    """The K in 1..k_max with the least expected time per committed token (the smallest on ties)."""
    return min(range(1, k_max + 1), key=lambda k: time_per_token(costs, k))
