"""Fused INT4 (GPTQ layout) MoE routed experts in Triton: device-side alignment, two GEMM launches, sum over k."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specter.kernels.moe_align import Alignment, MoEWorkspace, compiled_launch, moe_align_block_size, scratch
from specter.quant.int4 import PACK, Int4Linear

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the module still imports; the entry points raise RuntimeError
    triton = tl = None
    TRITON_AVAILABLE = False


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes: rows of routed (token, slot) pairs per block, output columns per tile, K per step.

    block_k must divide the quantization group (one scale row per K step); every dim is >= 16 for tl.dot.
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = KernelConfig()


if TRITON_AVAILABLE:

    @triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel for every window length
    def _gate_up_kernel(
        x_ptr, qw_ptr, sc_ptr, out_ptr,  # hidden [T, H]; qweight [E, H/8, 2I]; scales [E, H/g, 2I]; out [rows, I]
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        num_pairs, top_k, K, N, group_size, block_offset,
        stride_xt, stride_qe, stride_qk, stride_se, stride_sk, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One M-block of routed rows x one N-tile of I: silu(x W_gate) * (x W_up), INT4 dequantized in registers."""
        block = tl.program_id(0) + block_offset
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(expert_ids_ptr + block)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pairs = tl.load(sorted_ids_ptr + rows)  # [BM]
        valid = pairs < num_pairs
        tokens = tl.where(valid, pairs // top_k, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        offs_p = tl.arange(0, BLOCK_K // 8)  # packed rows of one K step
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_p[None, :] * 8  # column 8p (+ nibble j)
        q_ptrs = qw_ptr + expert * stride_qe + offs_p[:, None] * stride_qk + offs_n[None, :]
        s_ptrs = sc_ptr + expert * stride_se + offs_n
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            q_gate = tl.load(q_ptrs + (k0 // 8) * stride_qk, mask=n_mask[None, :], other=0)  # [BK/8, BN]
            q_up = tl.load(q_ptrs + (k0 // 8) * stride_qk + N, mask=n_mask[None, :], other=0)
            part_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):  # nibble j of packed row p is input column 8p + j
                x = tl.load(x_ptrs + k0 + j, mask=valid[:, None], other=0.0)  # [BM, BK/8]
                w_gate = (((q_gate >> (4 * j)) & 0xF) - 8).to(x.dtype)  # exact small integers
                w_up = (((q_up >> (4 * j)) & 0xF) - 8).to(x.dtype)
                part_gate += tl.dot(x, w_gate)
                part_up += tl.dot(x, w_up)
            s_row = (k0 // group_size) * stride_sk
            s_gate = tl.load(s_ptrs + s_row, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            s_up = tl.load(s_ptrs + s_row + N, mask=n_mask, other=0.0).to(tl.float32)
            acc_gate += part_gate * s_gate[None, :]
            acc_up += part_up * s_up[None, :]
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up, fp32
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel for every window length
    def _down_kernel(
        a_ptr, qw_ptr, sc_ptr, w_ptr, out_ptr,  # act [rows, I]; qweight [E, I/8, H]; scales [E, I/g, H];
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,  # routing weights [T*k]; out [T*k, H] fp32
        num_pairs, K, N, group_size, block_offset,
        stride_am, stride_qe, stride_qk, stride_se, stride_sk, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One M-block x one N-tile of H: (act W_down) * routing weight, written to the (token, slot) row."""
        block = tl.program_id(0) + block_offset
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(expert_ids_ptr + block)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pairs = tl.load(sorted_ids_ptr + rows)  # [BM]
        valid = pairs < num_pairs
        pairs = tl.where(valid, pairs, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        offs_p = tl.arange(0, BLOCK_K // 8)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_p[None, :] * 8
        q_ptrs = qw_ptr + expert * stride_qe + offs_p[:, None] * stride_qk + offs_n[None, :]
        s_ptrs = sc_ptr + expert * stride_se + offs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            q = tl.load(q_ptrs + (k0 // 8) * stride_qk, mask=n_mask[None, :], other=0)  # [BK/8, BN]
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):
                a = tl.load(a_ptrs + k0 + j, mask=valid[:, None], other=0.0)  # [BM, BK/8]
                part += tl.dot(a, (((q >> (4 * j)) & 0xF) - 8).to(a.dtype))
            s = tl.load(s_ptrs + (k0 // group_size) * stride_sk, mask=n_mask, other=0.0).to(tl.float32)
            acc += part * s[None, :]
        weight = tl.load(w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)  # [BM]
        out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc * weight[:, None], mask=valid[:, None] & n_mask[None, :])


def is_silu(act: Callable | None) -> bool:
    if act is None or act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU):
        return True
    return "silu" in type(act).__name__.lower()  # transformers' SiLUActivation


def check_int4_moe_args(kernel: str, hidden, top_k_index, gate_up: Int4Linear, down: Int4Linear, act,
                        block_k: int) -> None:
    """The arguments every INT4 MoE Triton kernel (`kernel` names it in the errors) accepts: Triton, SiLU
    experts, matching shapes, and K steps of `block_k` that divide the group and the input dims."""
    if not TRITON_AVAILABLE:
        raise RuntimeError(f"{kernel} needs triton (pip install triton); use int4_moe_reference")
    if not is_silu(act):
        raise ValueError(f"{kernel} implements SiLU-gated experts only, got act={act!r}")
    h = hidden.shape[-1]
    e, inter = gate_up.qweight.shape[0], down.in_features
    if gate_up.in_features != h or gate_up.out_features != 2 * inter or down.out_features != h:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, gate_up {tuple(gate_up.qweight.shape)}, "
                         f"down {tuple(down.qweight.shape)}")
    if down.qweight.shape[0] != e or top_k_index.dim() != 2 or hidden.dim() != 2:
        raise ValueError("expected hidden [T, H], top_k_index [T, k] and weights stacked over the same experts")
    for packed in (gate_up, down):
        if packed.group_size % block_k or packed.in_features % block_k or block_k % (PACK * 16):
            raise ValueError(f"block_k={block_k} must divide the group {packed.group_size} and the input "
                             f"dim {packed.in_features}, and be a multiple of 128")


@dataclass
class _Call:
    """Everything one layer call launches with (checked inputs, alignment, scratch buffers)."""

    hidden: torch.Tensor  # [T, H], contiguous
    flat_weights: torch.Tensor  # [T*k] routing weights
    gate_up: Int4Linear
    down: Int4Linear
    align: Alignment
    inter_buf: torch.Tensor  # [max_padded, I], activation dtype
    pair_out: torch.Tensor  # [T*k, H] fp32, weighted expert output per (token, slot)
    top_k: int
    cfg: KernelConfig
    workspace: MoEWorkspace | None  # holds the kernels' compiled launches


def _contiguous(packed: Int4Linear) -> Int4Linear:
    return Int4Linear(packed.qweight.contiguous(), packed.scales.contiguous(), packed.group_size)


def _prepare(hidden, top_k_index, top_k_weights, gate_up, down, workspace, cfg) -> _Call:
    hidden = hidden.contiguous()  # [T, H]
    align = moe_align_block_size(top_k_index, gate_up.qweight.shape[0], cfg.block_m, workspace)
    inter_buf = scratch(workspace, "intermediate", (align.sorted_pair_ids.numel(), down.in_features),
                         hidden.dtype, hidden.device)  # [max_padded, I]
    pair_out = scratch(workspace, "pair_out", (top_k_index.numel(), hidden.shape[1]), torch.float32,
                        hidden.device)  # [T*k, H]
    return _Call(hidden, top_k_weights.reshape(-1).contiguous(), _contiguous(gate_up), _contiguous(down),
                 align, inter_buf, pair_out, top_k_index.shape[1], cfg, workspace)


def _launch_gate_up(c: _Call, grid_m: int, block_offset: int) -> None:
    qw, sc, cfg = c.gate_up.qweight, c.gate_up.scales, c.cfg  # [E, H/8, 2I], [E, H/g, 2I]
    n_inter = c.inter_buf.shape[1]
    compiled_launch(c.workspace, _gate_up_kernel)(
        (grid_m, triton.cdiv(n_inter, cfg.block_n)),
        c.hidden, qw, sc, c.inter_buf, c.align.sorted_pair_ids, c.align.expert_ids, c.align.num_padded,
        c.pair_out.shape[0], c.top_k, c.hidden.shape[1], n_inter, c.gate_up.group_size, block_offset,
        c.hidden.stride(0), qw.stride(0), qw.stride(1), sc.stride(0), sc.stride(1), c.inter_buf.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_down(c: _Call, grid_m: int, block_offset: int) -> None:
    qw, sc, cfg = c.down.qweight, c.down.scales, c.cfg  # [E, I/8, H], [E, I/g, H]
    n_out = c.pair_out.shape[1]
    compiled_launch(c.workspace, _down_kernel)(
        (grid_m, triton.cdiv(n_out, cfg.block_n)),
        c.inter_buf, qw, sc, c.flat_weights, c.pair_out, c.align.sorted_pair_ids, c.align.expert_ids,
        c.align.num_padded, c.pair_out.shape[0], c.inter_buf.shape[1], n_out, c.down.group_size, block_offset,
        c.inter_buf.stride(0), qw.stride(0), qw.stride(1), sc.stride(0), sc.stride(1), c.pair_out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _reduce(c: _Call) -> torch.Tensor:
    return c.pair_out.view(-1, c.top_k, c.pair_out.shape[1]).sum(dim=1).to(c.hidden.dtype)  # [T, H]


def fused_int4_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: Int4Linear, down: Int4Linear, act: Callable | None = None,
                   workspace: MoEWorkspace | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Routed experts [T, H] with INT4 weights: same result as `int4_moe_reference`; act must be SiLU (or None).

    Launches: a few torch ops for the alignment, one gate_up GEMM, one down GEMM, one sum over k.
    No host synchronisation. `workspace` keeps the intermediate buffers between calls.
    """
    cfg = config or DEFAULT_CONFIG
    check_int4_moe_args("fused_int4_moe", hidden, top_k_index, gate_up, down, act, cfg.block_k)
    if top_k_index.numel() == 0:
        return torch.zeros_like(hidden)
    c = _prepare(hidden, top_k_index, top_k_weights, gate_up, down, workspace, cfg)
    grid_m = c.align.expert_ids.numel()  # upper bound on M-blocks; blocks past num_padded exit at once
    _launch_gate_up(c, grid_m, 0)
    _launch_down(c, grid_m, 0)
    return _reduce(c)


def unfused_int4_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: Int4Linear, down: Int4Linear, act: Callable | None = None,
                     workspace: MoEWorkspace | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Same result as `fused_int4_moe`, but the same two kernels launch once per expert with tokens.

    The comparison point for the fused launch; reads the per-expert counts to the host (one sync).
    """
    cfg = config or DEFAULT_CONFIG
    check_int4_moe_args("unfused_int4_moe", hidden, top_k_index, gate_up, down, act, cfg.block_k)
    if top_k_index.numel() == 0:
        return torch.zeros_like(hidden)
    c = _prepare(hidden, top_k_index, top_k_weights, gate_up, down, workspace, cfg)
    start = 0
    for rows in c.align.padded_counts.tolist():  # per expert, ascending; the one host sync
        if rows:
            blocks = rows // cfg.block_m
            _launch_gate_up(c, blocks, start)
            _launch_down(c, blocks, start)
            start += blocks
    return _reduce(c)
