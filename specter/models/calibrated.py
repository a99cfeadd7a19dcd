"""Calibrated synthetic weights: seeded weights whose routing locality, draft acceptance and logit margins
follow a real checkpoint's (see RoutingProfile in the registry and docs/design.md, "Calibrated workload").

The residual stream is laid out in four orthogonal parts (all orthogonal to the all-ones vector, so RMSNorm
and LayerNorm treat them alike):
- a *routing subspace* R that only the routers read. A token's embedding carries there a mix of slowly
  varying "factor" vectors (constant over runs of consecutive tokens along the model's greedy walk) and a
  vector of its own; consecutive tokens therefore route to overlapping experts, as in real text;
- a *token subspace* T (the rest) where each token has a random unit vector that the LM head reads: the
  row of token v reads the vector of its predecessor on a fixed random cycle through the vocabulary, so
  greedy decoding walks that cycle (no short loops) with a wide top-1 margin;
- one *acceptance direction* g that no full-precision tensor writes: embeddings, attention and every
  expert's down projection are orthogonal to it, and the writers no draft quantizes (attention, shared and
  dense MLPs) write exact zeros on g's coordinates, so their 16-bit rounding cannot land on g. The INT4
  draft's down-projection error is not orthogonal to g, and the
  LM head couples g to each token's runner-up (its successor's successor), so the draft disagrees with
  the target only through its quantization error, at a rate set by `accept_gain`.
Routers, attention and experts are otherwise the HF model's seeded random weights.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specter.errors import SpecterError
from specter.models.tokenizer import ByteTokenizer

RUNNER_UP_SHARE = 0.5  # runner-up logit / top-1 logit on the target's walk
TOP1_LOGIT = 16.0  # the successor's logit (sets how peaked sampling is at temperature 1)
RESIDUAL_WRITERS = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")  # attention, MLPs
LAYOUT_SEED = 7919  # offset of the calibration's own random stream from the build seed
TOKEN_SHARE = 0.5  # share of the embedding's energy in the token subspace (the rest routes)


@dataclass(frozen=True)
class RoutingProfile:
    """Fitted parameters of a calibrated build, with the real measurements they reproduce.

    factors: (weight, mean run length in tokens) of each slowly varying routing factor; an infinite run
      length is a per-layer expert popularity shared by every token.
    token_weight: weight of each token's own routing vector (fast, token-to-token variation).
    accept_gain: LM-head gain of the acceptance direction, per sqrt(MoE layer); larger = lower acceptance.
    embed_scale: RMS of the embeddings; the larger, the less attention and expert outputs (HF's seeded init)
      blur the designed routing (and the smaller the INT4 error's share of the router input).
    target: the real model's row of routing-locality.tsv that the factors were fitted to, e.g.
      {"LRU@1": 0.28, ...}, and `source`: where that row comes from.
    clear_routing: keep attention and expert outputs out of the routing subspace too (as out of g), so
      every layer's routers read the embedding's routing part alone and locality does not thin with depth.
    token_pick: weight of each token's own pick, a push toward one random expert in every MoE layer (router
      rows are then mutually orthonormal, which needs MoE layers x experts <= H/4). The pick tends to take
      rank 1, leaving rank 2 to the slowly varying part: a second-ranked expert more often reused by the
      next token than the first, as in Phi-3.5-MoE (0 = no pick; the routers are then random rows).
    """

    factors: tuple[tuple[float, float], ...]
    token_weight: float
    accept_gain: float
    embed_scale: float = 1.0
    target: tuple[tuple[str, float], ...] = ()
    source: str = ""
    clear_routing: bool = False
    token_pick: float = 0.0


@dataclass(frozen=True)
class Layout:
    """Orthonormal bases of the residual stream's parts: g [H], routing [H, d_r], token [H, d_t]."""

    g: torch.Tensor
    routing: torch.Tensor
    token: torch.Tensor


def routing_profile(spec) -> RoutingProfile:
    """The spec's fitted RoutingProfile, or a one-line error for a model that has none."""
    if spec.routing_profile is None:
        raise SpecterError(f"{spec.name} has no calibrated routing profile; use weights=synthetic")
    return spec.routing_profile


def special_ids(config) -> set[int]:
    """Token ids outside the calibrated walk: the byte tokenizer's BOS/EOS/PAD and the config's."""
    ids = {ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id, ByteTokenizer.pad_token_id}
    return ids | {i for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if isinstance(i, int)}


def moe_layer_count(config) -> int:
    """MoE layers of a registered config (DeepSeek-V2 keeps its first layers dense)."""
    return config.num_hidden_layers - int(getattr(config, "first_k_dense_replace", 0) or 0)


def residual_layout(hidden: int, generator: torch.Generator) -> Layout:
    """g on a few coordinates of their own (zero-sum); R (a quarter of the dimensions) and T: an orthonormal
    basis of the other coordinates, orthogonal to ones.

    Keeping g off the coordinates that embeddings and the LM head's token part use matters in 16-bit: no
    rounding of a large embedding entry leaks along g, and the LM head's large g entries sit in columns of
    their own instead of swamping the token part of every column.
    """
    coords = torch.randperm(hidden, generator=generator)
    own, rest = coords[:acceptance_coordinates(hidden)], coords[acceptance_coordinates(hidden):]
    g = torch.zeros(hidden)
    g[own] = torch.randn(len(own), generator=generator)
    g[own] -= g[own].mean()
    g /= g.norm()
    d_r = max(8, hidden // 4)
    d_t = len(rest) - d_r - 1
    ones = torch.ones(len(rest), 1) / math.sqrt(len(rest))
    q, _ = torch.linalg.qr(torch.cat([ones, torch.randn(len(rest), len(rest) - 1, generator=generator)], dim=1))
    basis = torch.zeros(hidden, len(rest))
    basis[rest] = q * torch.sign(q[:, :1].sum())  # [H, H - m]; column 0 is +-ones on `rest`
    return Layout(g=g, routing=basis[:, 1:1 + d_r], token=basis[:, 1 + d_r:1 + d_r + d_t])


def acceptance_coordinates(hidden: int) -> int:
    """How many coordinates carry the acceptance direction."""
    return max(8, hidden // 32)


def acceptance_direction(hidden: int, seed: int) -> torch.Tensor:
    """The unit vector g of a calibrated build with this seed (the same draw `calibrate` makes first)."""
    return residual_layout(hidden, torch.Generator().manual_seed(seed + LAYOUT_SEED)).g


def walk_cycle(vocab_size: int, special: set[int], generator: torch.Generator) -> torch.Tensor:
    """A random cyclic order of the non-special token ids: the target's greedy walk."""
    ids = torch.tensor([i for i in range(vocab_size) if i not in special])
    return ids[torch.randperm(len(ids), generator=generator)]


def runs(length: int, mean_run: float, generator: torch.Generator) -> torch.Tensor:
    """Run index of each position: a new run starts with probability 1/mean_run (geometric run lengths)."""
    starts = torch.rand(length, generator=generator) < 1.0 / max(mean_run, 1.0)  # inf: one run
    starts[0] = False
    return torch.cumsum(starts.long(), 0)  # [length]


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def routing_codes(cycle_len: int, profile: RoutingProfile, d_r: int, generator: torch.Generator,
                  picks: torch.Tensor | None = None) -> torch.Tensor:
    """[cycle_len, d_r] unit routing vectors along the cycle: weighted factor vectors plus each token's own
    (and, given `picks` [cycle_len, d_r], `token_pick` times each token's pick)."""
    codes = profile.token_weight * unit_rows(torch.randn(cycle_len, d_r, generator=generator))
    for weight, mean_run in profile.factors:
        run = runs(cycle_len, mean_run, generator)
        factor = unit_rows(torch.randn(int(run[-1]) + 1, d_r, generator=generator))
        codes += weight * factor[run]
    if picks is None:
        return unit_rows(codes)
    return unit_rows(unit_rows(codes) + profile.token_pick * picks)


def orthonormal_router_rows(layers: int, experts: int, d_r: int, generator: torch.Generator) -> torch.Tensor:
    """[layers, E, d_r]: router rows of every MoE layer, all mutually orthonormal."""
    if layers * experts > d_r:
        raise SpecterError(f"token_pick needs MoE layers x experts ({layers} x {experts}) <= {d_r} routing "
                           "dimensions; use a profile without token_pick")
    q, _ = torch.linalg.qr(torch.randn(d_r, layers * experts, generator=generator))  # [d_r, L*E]
    return q.T.reshape(layers, experts, d_r)


def token_picks(positions: int, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[positions, d_r]: per position, the sum over layers of the router row of one random expert each."""
    layers, experts, _ = rows.shape
    picked = torch.randint(0, experts, (positions, layers), generator=generator)  # [T, L]
    return rows[torch.arange(layers), picked].sum(dim=1)  # [T, L, d_r] -> [T, d_r]


def simulated_routing(tokens: int, profile: RoutingProfile, experts: int, top_k: int, d_r: int, layers: int,
                      generator: torch.Generator) -> list[list[list[int]]]:
    """[layers][tokens][top_k] expert ids (rank order) of the calibrated routing, simulated without a model:
    one walk's routing codes through each layer's router rows (random rows, or with `token_pick` the
    build's orthonormal rows and per-layer picks)."""
    rows, picks = None, None
    if profile.token_pick:
        rows = orthonormal_router_rows(layers, experts, d_r, generator)  # [L, E, d_r]
        picks = token_picks(tokens, rows, generator)
    codes = routing_codes(tokens, profile, d_r, generator, picks)  # [T, d_r]
    if rows is None:
        rows = torch.stack([torch.randn(experts, d_r, generator=generator) for _ in range(layers)])
    return [(codes @ layer_rows.T).topk(top_k, dim=1).indices.tolist() for layer_rows in rows]


def calibrated_embeddings(vocab: int, cycle: torch.Tensor, layout: Layout, profile: RoutingProfile,
                          generator: torch.Generator, picks: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], token vectors [V, d_t]); rows have RMS embed_scale, no component along g or ones."""
    d_r, d_t = layout.routing.shape[1], layout.token.shape[1]
    route = unit_rows(torch.randn(vocab, d_r, generator=generator))  # special ids: random routing
    route[cycle] = routing_codes(len(cycle), profile, d_r, generator, picks)
    token = unit_rows(torch.randn(vocab, d_t, generator=generator))  # [V, d_t]
    hidden = layout.g.shape[0]
    embed = profile.embed_scale * math.sqrt(hidden) * (math.sqrt(1 - TOKEN_SHARE) * route @ layout.routing.T
                                 + math.sqrt(TOKEN_SHARE) * token @ layout.token.T)  # [V, H]
    return embed, token


def calibrated_lm_head(vocab: int, cycle: torch.Tensor, token: torch.Tensor, layout: Layout, gain: float,
                       generator: torch.Generator) -> torch.Tensor:
    """[V, H]: the row of cycle[i+1] reads cycle[i]'s token vector (top-1), the row of cycle[i+2] reads it at
    RUNNER_UP_SHARE (runner-up); every walk row has +-gain along g. Special ids get zero rows."""
    hidden = layout.g.shape[0]
    scale = TOP1_LOGIT / (math.sqrt(hidden) * math.sqrt(TOKEN_SHARE))
    reads = token[cycle.roll(1)] + RUNNER_UP_SHARE * token[cycle.roll(2)]  # [n, d_t]: row of cycle[i]
    sign = torch.randint(0, 2, (len(cycle),), generator=generator).float() * 2 - 1
    head = torch.zeros(vocab, hidden)
    head[cycle] = scale * reads @ layout.token.T + gain * TOP1_LOGIT * sign[:, None] * layout.g[None, :]
    return head


def remove_direction(weight: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """`weight` with its component along unit vector g (over dimension `dim`, the output) removed."""
    g = g.to(weight.device, torch.float32)
    moved = weight.float().movedim(dim, -1)  # [..., H]
    moved = moved - (moved @ g)[..., None] * g
    return moved.movedim(-1, dim).to(weight.dtype)


def remove_subspace(weight: torch.Tensor, basis: torch.Tensor, dim: int) -> torch.Tensor:
    """`weight` with its components in the span of orthonormal `basis` [H, m] (over dimension `dim`) removed."""
    basis = basis.to(weight.device, torch.float32)
    moved = weight.float().movedim(dim, -1)  # [..., H]
    moved = moved - (moved @ basis) @ basis.T
    return moved.movedim(-1, dim).to(weight.dtype)


def zero_coordinates(weight: torch.Tensor, coords: torch.Tensor, dim: int) -> torch.Tensor:
    """`weight` with its entries at output coordinates `coords` (over dimension `dim`) set to zero."""
    out = weight.clone()
    out.index_fill_(dim, coords.to(weight.device), 0)
    return out


def quiet_writer(name: str) -> bool:
    """A full-precision residual writer that no draft quantizes (attention, shared and dense MLPs): it writes
    nothing on g's coordinates, so 16-bit rounding there (of its weights, its outputs, the stream) is zero."""
    return name.endswith(RESIDUAL_WRITERS) and ".experts." not in name


def writes_cleared(layout: Layout, profile: RoutingProfile) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """`clear(weight, dim)`: a residual writer's weight with no full-precision write along g (and, with
    `clear_routing`, none into the routing subspace); `dim` is the weight's output (hidden) dimension."""
    def clear(weight: torch.Tensor, dim: int) -> torch.Tensor:
        weight = remove_direction(weight, layout.g, dim)
        return remove_subspace(weight, layout.routing, dim) if profile.clear_routing else weight
    return clear


def routers(hf_model: nn.Module, hidden: int) -> list[nn.Module]:
    """The router of every sparse-MoE block: the sibling of its routed experts with an [E, H] weight."""
    found = []
    for module in hf_model.modules():
        experts = getattr(module, "experts", None)
        if experts is None or not type(experts).__name__.endswith("Experts"):
            continue
        e = getattr(experts, "num_experts", None) or experts.gate_up_proj.shape[0]
        found += [child for name, child in module.named_children()
                  if name != "experts" and getattr(child, "weight", None) is not None
                  and tuple(child.weight.shape) == (e, hidden)]
    return found


@torch.no_grad()
def calibrate(hf_model: nn.Module, profile: RoutingProfile, special: set[int], num_moe_layers: int,
              seed: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Rewrite a seeded HF MoE model in place into the calibrated layout; returns `clear(weight, dim)`, which
    routed experts added later (e.g. straight into host memory) must pass through (`writes_cleared`)."""
    generator = torch.Generator().manual_seed(seed + LAYOUT_SEED)
    embed = hf_model.get_input_embeddings().weight
    vocab, hidden = embed.shape
    layout = residual_layout(hidden, generator)
    cycle = walk_cycle(vocab, special, generator)
    moe_routers = routers(hf_model, hidden)
    picked_rows, picks = None, None
    if profile.token_pick and moe_routers:  # a stream of its own: the main stream's draws do not depend on it
        pick_generator = torch.Generator().manual_seed(seed + LAYOUT_SEED + 1)
        picked_rows = orthonormal_router_rows(len(moe_routers), moe_routers[0].weight.shape[0],
                                              layout.routing.shape[1], pick_generator)  # [L, E, d_r]
        picks = token_picks(len(cycle), picked_rows, pick_generator)
    embedding, token = calibrated_embeddings(vocab, cycle, layout, profile, generator, picks)
    embed.copy_(embedding.to(embed.dtype))
    del embedding
    head = hf_model.get_output_embeddings()
    gain = profile.accept_gain / math.sqrt(max(num_moe_layers, 1))
    head.weight.copy_(calibrated_lm_head(vocab, cycle, token, layout, gain, generator).to(head.weight.dtype))
    if getattr(head, "bias", None) is not None:
        head.bias.zero_()
    for index, router in enumerate(moe_routers):
        w = router.weight  # [E, H]: rows inside the routing subspace, random or the picks' (same norm)
        if picked_rows is None:
            rows = torch.randn(w.shape[0], layout.routing.shape[1], generator=generator) / math.sqrt(hidden)
        else:
            rows = picked_rows[index] * math.sqrt(layout.routing.shape[1] / hidden)
        w.copy_((rows @ layout.routing.T).to(w.dtype))
    clear = writes_cleared(layout, profile)
    own = layout.g.nonzero().flatten()  # g's coordinates
    for name, param in hf_model.named_parameters():  # every tensor that writes into the residual stream
        if quiet_writer(name):  # Linear weight [H, in] or bias [H]
            param.copy_(zero_coordinates(clear(param, 0), own, 0))
        elif name.endswith(RESIDUAL_WRITERS):
            param.copy_(clear(param, 0))
        elif name.endswith("down_proj"):  # routed experts [E, H, I]
            param.copy_(clear(param, 1))
    return clear
