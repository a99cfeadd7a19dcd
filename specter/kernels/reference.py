"""Plain torch references for routed-expert computation (expert-wise grouping, FP and INT4 weights)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specter.quant.int4 import Int4Linear, dequantize, select_expert

ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # e -> (gate_up [2I, H], down [H, I])


@dataclass
class ExpertGroups:
    """Routed (token, slot) pairs sorted by expert: the expert-wise execution order of one layer."""

    experts: list[int]  # experts with at least one token, ascending
    token_idx: list[torch.Tensor]  # per expert: token positions [n_e]
    weight_idx: list[torch.Tensor]  # per expert: flat (token * k + slot) index into top_k_weights [n_e]


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the [T, k] routing by expert (stable, so tokens stay in order); one host sync for the counts."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    experts, tokens, weights, start = [], [], [], 0
    for e, n in enumerate(counts):
        if n:
            sel = order[start:start + n]
            experts.append(e)
            tokens.append(sel // k)
            weights.append(sel)
            start += n
    return ExpertGroups(experts, tokens, weights)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """One expert's gated MLP on its gathered tokens x [n, H] -> [n, H]."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
    return torch.nn.functional.linear(act(gate) * up, down)


def expert_wise_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights_of: ExpertWeights,
    num_experts: int,
    act: Callable,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H]: tokens gathered per expert, one GEMM per expert, weighted sum over k.

    Each expert's output fills its (token, slot) rows; the rows are combined with the routing weights
    at the end, so the result is the same whatever order the experts run in.
    """
    groups = groups or group_by_expert(top_k_index, num_experts)
    rows = hidden.new_zeros(top_k_index.numel(), hidden.shape[-1])  # [T*k, H]
    for e, tok, widx in zip(groups.experts, groups.token_idx, groups.weight_idx):
        gate_up, down = weights_of(e)
        rows[widx] = expert_mlp(hidden[tok], gate_up, down, act).to(rows.dtype)  # [n_e, H]
    return combine_rows(rows, top_k_weights, hidden.dtype)


def combine_rows(rows: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum over the k slots: rows [T*k, H], weights [T, k] -> [T, H]."""
    weighted = rows.view(*top_k_weights.shape, -1) * top_k_weights.unsqueeze(-1)  # [T, k, H]
    return weighted.sum(dim=1).to(dtype)


def token_wise_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights_of: ExpertWeights,
    act: Callable,
) -> torch.Tensor:
    """Chronological token-by-token reference (one GEMV per token and slot); same result as expert_wise_moe."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot in range(top_k_index.shape[1]):
            gate_up, down = weights_of(int(top_k_index[t, slot]))
            y = expert_mlp(hidden[t:t + 1], gate_up, down, act)
            out[t] += (y[0] * top_k_weights[t, slot]).to(out.dtype)
    return out


def int4_moe_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: Int4Linear,
    down: Int4Linear,
    act: Callable,
) -> torch.Tensor:
    """Draft-mode routed experts with INT4 weights: dequantize each routed expert, then expert-wise GEMMs."""
    num_experts = gate_up.qweight.shape[0]

    def weights_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize(select_expert(gate_up, e), hidden.dtype),
                dequantize(select_expert(down, e), hidden.dtype))

    return expert_wise_moe(hidden, top_k_index, top_k_weights, weights_of, num_experts, act)
