"""INT4 (GPTQ layout) routed experts for few (token, slot) pairs in Triton: one GEMV program row per pair.

At decode (a draft step routes one token per request to k experts) the tiled kernels of `int4_moe` spend
a tensor-core tile of `block_m` rows on each routed pair and run one program per SM. Here each program
owns one pair and a strip of output columns: it unpacks the nibbles in registers and accumulates with
plain FMAs (no tile shuffles through shared memory), reading the pair's expert straight from
`top_k_index` (no sort-and-pad launch). Same result as `int4_moe_reference` up to fp32 summation order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specter.kernels.int4_moe import TRITON_AVAILABLE, check_int4_moe_args
from specter.kernels.moe_align import MoEWorkspace, compiled_launch, scratch
from specter.quant.int4 import Int4Linear

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

DECODE_MAX_PAIRS = 48  # routed (token, slot) pairs up to which the draft takes this path (H200: faster at 48)


@dataclass(frozen=True)
class DecodeConfig:
    """Output columns per program for each GEMV, K per step (one quantization group), launch options."""

    gate_up_block_n: int = 32
    down_block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_DECODE_CONFIG = DecodeConfig()


if TRITON_AVAILABLE:

    @triton.jit
    def _int4_dot_strip(x_ptr, q_ptrs, s_ptrs, K, group_size, stride_qk, stride_sk, n_mask,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """sum_k x[k] * w[k, n] for one strip of columns: x [K] (one row), q_ptrs/s_ptrs at row 0 of the strip."""
        offs_p = tl.arange(0, BLOCK_K // 8)  # packed rows of one K step
        acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)  # [BK/8, BN], reduced over rows at the end
        for k0 in range(0, K, BLOCK_K):
            q = tl.load(q_ptrs + (k0 // 8 + offs_p[:, None]) * stride_qk, mask=n_mask[None, :], other=0)
            part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):  # nibble j of packed row p is input column 8p + j
                x = tl.load(x_ptr + k0 + offs_p * 8 + j).to(tl.float32)  # [BK/8]
                part += x[:, None] * ((((q >> (4 * j)) & 0xF) - 8).to(tl.float32))
            s = tl.load(s_ptrs + (k0 // group_size) * stride_sk, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            acc += part * s[None, :]
        return tl.sum(acc, axis=0)  # [BN]

    @triton.jit
    def _gate_up_decode_kernel(
        x_ptr, qw_ptr, sc_ptr, ids_ptr, out_ptr,  # hidden [T, H]; qweight [E, H/8, 2I]; scales [E, H/g, 2I];
        top_k, K, N, group_size,  # expert ids [P] (P = T*k); out [P, I]
        stride_xt, stride_qe, stride_qk, stride_se, stride_sk, stride_om,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Pair program_id(0), columns strip program_id(1) of I: silu(x W_gate) * (x W_up)."""
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair)
        x_ptr += (pair // top_k) * stride_xt
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        q_ptrs = qw_ptr + expert * stride_qe + offs_n[None, :]
        s_ptrs = sc_ptr + expert * stride_se + offs_n
        gate = _int4_dot_strip(x_ptr, q_ptrs, s_ptrs, K, group_size, stride_qk, stride_sk, n_mask, BLOCK_N, BLOCK_K)
        up = _int4_dot_strip(x_ptr, q_ptrs + N, s_ptrs + N, K, group_size, stride_qk, stride_sk, n_mask,
                             BLOCK_N, BLOCK_K)
        act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, fp32
        tl.store(out_ptr + pair * stride_om + offs_n, act.to(out_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _down_decode_kernel(
        a_ptr, qw_ptr, sc_ptr, ids_ptr, w_ptr, out_ptr,  # act [P, I]; qweight [E, I/8, H]; scales [E, I/g, H];
        K, N, group_size,  # expert ids [P]; routing weights [P]; out [P, H] fp32
        stride_am, stride_qe, stride_qk, stride_se, stride_sk, stride_om,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Pair program_id(0), columns strip program_id(1) of H: (act W_down) * routing weight."""
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        q_ptrs = qw_ptr + expert * stride_qe + offs_n[None, :]
        s_ptrs = sc_ptr + expert * stride_se + offs_n
        acc = _int4_dot_strip(a_ptr + pair * stride_am, q_ptrs, s_ptrs, K, group_size, stride_qk, stride_sk,
                              n_mask, BLOCK_N, BLOCK_K)
        weight = tl.load(w_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair * stride_om + offs_n, acc * weight, mask=n_mask)


def int4_moe_decode(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up: Int4Linear, down: Int4Linear, act: Callable | None = None,
                    workspace: MoEWorkspace | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """Routed experts [T, H] with INT4 weights, one GEMV program row per (token, slot) pair: the result of
    `int4_moe_reference` up to summation order. Two launches and a sum over k; no host synchronisation."""
    cfg = config or DEFAULT_DECODE_CONFIG
    check_int4_moe_args("int4_moe_decode", hidden, top_k_index, gate_up, down, act, cfg.block_k)
    if top_k_index.numel() == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()  # [T, H]
    pairs, top_k, n_hidden, n_inter = top_k_index.numel(), top_k_index.shape[1], hidden.shape[1], down.in_features
    ids = top_k_index.reshape(-1).contiguous()  # [P], P = T*k
    weights = top_k_weights.reshape(-1).contiguous()  # [P]
    inter = scratch(workspace, "decode_intermediate", (pairs, n_inter), hidden.dtype, hidden.device)  # [P, I]
    pair_out = scratch(workspace, "decode_pair_out", (pairs, n_hidden), torch.float32, hidden.device)  # [P, H]
    qw, sc = gate_up.qweight.contiguous(), gate_up.scales.contiguous()  # [E, H/8, 2I], [E, H/g, 2I]
    compiled_launch(workspace, _gate_up_decode_kernel)(
        (pairs, triton.cdiv(n_inter, cfg.gate_up_block_n)), hidden, qw, sc, ids, inter, top_k, n_hidden, n_inter,
        gate_up.group_size, hidden.stride(0), qw.stride(0), qw.stride(1), sc.stride(0), sc.stride(1),
        inter.stride(0), BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    qw, sc = down.qweight.contiguous(), down.scales.contiguous()  # [E, I/8, H], [E, I/g, H]
    compiled_launch(workspace, _down_decode_kernel)(
        (pairs, triton.cdiv(n_hidden, cfg.down_block_n)), inter, qw, sc, ids, weights, pair_out, n_inter, n_hidden,
        down.group_size, inter.stride(0), qw.stride(0), qw.stride(1), sc.stride(0), sc.stride(1),
        pair_out.stride(0), BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return pair_out.view(-1, top_k, n_hidden).sum(dim=1).to(hidden.dtype)  # [T, H]
