"""Routed-expert MLP rows for FP experts held in a device slot buffer, in Triton: two launches per call."""
from __future__ import annotations

from collections.abc import Callable

import torch

from specter.kernels.int4_moe import KernelConfig, MoEWorkspace, is_silu, moe_align_block_size, scratch
from specter.kernels.moe_align import Alignment, compiled_launch
from specter.kernels.reference import expert_mlp

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the module still imports; slot_moe_rows raises RuntimeError
    triton = tl = None
    TRITON_AVAILABLE = False

DEFAULT_CONFIG = KernelConfig(block_m=16, block_n=64, block_k=64)  # FP weights: no quantization group


def row_views(rows: torch.Tensor, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert layout, defined here only: rows [..., 3*I*H] hold gate_up [2I, H] then down [H, I].
    Returns views (gate_up [..., 2I, H], down [..., H, I]); host store rows and cache slots use it."""
    lead, numel = rows.shape[:-1], rows.shape[-1]
    hidden = numel // (3 * intermediate)
    split = 2 * intermediate * hidden
    return (rows[..., :split].view(*lead, 2 * intermediate, hidden),
            rows[..., split:].view(*lead, hidden, intermediate))


def slot_views(slot_buffer: torch.Tensor, slot: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (gate_up [2I, H], down [H, I]) of one slot row of `slot_buffer` [S, 3*I*H]."""
    return row_views(slot_buffer[slot], intermediate)


if TRITON_AVAILABLE:

    @triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel for every window length
    def _slot_gate_up_kernel(
        x_ptr, w_ptr, slot_ptr, out_ptr,  # hidden [T, H]; slots [S, 3IH]; slot_of_expert [E]; out [rows, I]
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        num_pairs, top_k, K, N, stride_xt, stride_ws, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One M-block of one expert's pairs x one N-tile of I: silu(x W_gate^T) * (x W_up^T)."""
        block = tl.program_id(0)
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        slot = tl.load(slot_ptr + tl.load(expert_ids_ptr + block)).to(tl.int64)
        if slot < 0:  # skipped experts get no M-block; defensive
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pairs = tl.load(sorted_ids_ptr + rows)  # [BM]
        valid = pairs < num_pairs
        tokens = tl.where(valid, pairs // top_k, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)  # [BK]
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
        g_ptrs = w_ptr + slot * stride_ws + offs_n[None, :] * K + offs_k[:, None]  # gate rows, [BK, BN]
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)  # [BM, BK]
            w_gate = tl.load(g_ptrs + k0, mask=n_mask[None, :], other=0.0).to(x.dtype)  # [BK, BN]
            w_up = tl.load(g_ptrs + N * K + k0, mask=n_mask[None, :], other=0.0).to(x.dtype)  # up rows follow
            acc_gate += tl.dot(x, w_gate)
            acc_up += tl.dot(x, w_up)
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up, fp32
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel for every window length
    def _slot_down_kernel(
        a_ptr, w_ptr, slot_ptr, out_ptr,  # act [rows, I]; slots [S, 3IH]; slot_of_expert [E]; out [T*k, H] fp32
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        num_pairs, K, N, down_offset, stride_am, stride_ws, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One M-block x one N-tile of H: act W_down^T, written (unweighted, fp32) to the (token, slot) row."""
        block = tl.program_id(0)
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        slot = tl.load(slot_ptr + tl.load(expert_ids_ptr + block)).to(tl.int64)
        if slot < 0:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pairs = tl.load(sorted_ids_ptr + rows)  # [BM]
        valid = pairs < num_pairs
        pairs = tl.where(valid, pairs, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)  # [BK]
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        d_ptrs = w_ptr + slot * stride_ws + down_offset + offs_n[None, :] * K + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)  # [BM, BK]
            w = tl.load(d_ptrs + k0, mask=n_mask[None, :], other=0.0).to(a.dtype)  # [BK, BN]
            acc += tl.dot(a, w)
        out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


def _check(hidden, top_k_index, slot_buffer, intermediate, rows, act, cfg) -> None:
    """The checks of a layer's launches (everything but the slot map, `_check_slot_map`)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("specter.kernels.slot_moe needs triton (pip install triton); use slot_moe_rows_reference")
    if not is_silu(act):
        raise ValueError(f"slot_moe_rows implements SiLU-gated experts only, got act={act!r}")
    if hidden.dim() != 2 or top_k_index.dim() != 2 or slot_buffer.dim() != 2:
        raise ValueError("expected hidden [T, H], top_k_index [T, k], slot_buffer [S, 3*I*H]")
    h = hidden.shape[1]
    if slot_buffer.shape[1] != 3 * intermediate * h or slot_buffer.stride(1) != 1:
        raise ValueError(f"slot_buffer {tuple(slot_buffer.shape)} is not [S, 3*I*H] (I={intermediate}, H={h}), "
                         "row-contiguous")
    if rows.dtype != torch.float32 or tuple(rows.shape) != (top_k_index.numel(), h) or rows.stride(1) != 1:
        raise ValueError(f"rows must be fp32 [T*k, H] = [{top_k_index.numel()}, {h}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if h % cfg.block_k or intermediate % cfg.block_k or min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"block_k={cfg.block_k} must divide H={h} and I={intermediate}; tiles must be >= 16")
    if not (slot_buffer.device == hidden.device == rows.device == top_k_index.device):
        raise ValueError("hidden, top_k_index, slot_buffer and rows must be on one device")


def _check_slot_map(slot_of_expert: torch.Tensor, device: torch.device) -> None:
    if slot_of_expert.dim() != 1 or slot_of_expert.device != device:
        raise ValueError(f"slot_of_expert must be [E] on {device}, got {tuple(slot_of_expert.shape)} on "
                         f"{slot_of_expert.device}")


def _align(top_k_index: torch.Tensor, slot_of_expert: torch.Tensor, block_m: int, workspace):
    """Alignment with skipped experts mapped to sentinel expert E (sorts last, gets no counted M-block)."""
    num_experts = slot_of_expert.numel()
    flat = top_k_index.reshape(-1).long()  # [P]
    keep = slot_of_expert.index_select(0, flat) >= 0  # [P], device-side
    routed = torch.where(keep, flat, torch.full_like(flat, num_experts)).view(top_k_index.shape)  # [T, k]
    align = moe_align_block_size(routed, num_experts + 1, block_m, workspace)
    num_padded = align.padded_counts[:num_experts].sum().view(1)  # [1] rows before the sentinel's segment
    return align, num_padded


def align_routing(top_k_index: torch.Tensor, num_experts: int, workspace: MoEWorkspace | None = None,
                  config: KernelConfig | None = None) -> Alignment:
    """The alignment of every routed pair, for several slot_moe_rows calls over one routing (a layer's
    waves): each call then only launches its two GEMMs, and blocks of experts without a slot in that
    call's map exit at once."""
    return moe_align_block_size(top_k_index, num_experts, (config or DEFAULT_CONFIG).block_m, workspace)


class SlotMoEWaves:
    """`slot_moe_rows` over one routing for one slot map after another (a verify layer's waves): the checks,
    buffers and both launches' arguments are prepared once, so a call only launches the two GEMMs (after its
    first, straight through the compiled kernels' launchers: `CompiledLaunch.bound`). Build it with
    `slot_moe_waves`; `alignment` covers every routed pair (`align_routing`), or is `_align`'s for one map,
    with `num_padded` its rows before the sentinel."""

    def __init__(self, hidden, top_k_index, slot_buffer, intermediate, rows, workspace, cfg, alignment,
                 num_padded) -> None:
        self.device, self.empty = hidden.device, top_k_index.numel() == 0
        hidden = hidden.contiguous()  # [T, H]
        inter_buf = scratch(workspace, "slot_intermediate", (alignment.sorted_pair_ids.numel(), intermediate),
                            hidden.dtype, hidden.device)  # [max_padded, I]
        num_pairs, h = rows.shape
        grid_m = alignment.expert_ids.numel()
        self.constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                           "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        ids = (alignment.sorted_pair_ids, alignment.expert_ids, num_padded)
        self.gate_up = (compiled_launch(workspace, _slot_gate_up_kernel),
                        (grid_m, triton.cdiv(intermediate, cfg.block_n)),
                        (hidden, slot_buffer, None, inter_buf, *ids, num_pairs, top_k_index.shape[1], h,
                         intermediate, hidden.stride(0), slot_buffer.stride(0), inter_buf.stride(0)))
        self.down = (compiled_launch(workspace, _slot_down_kernel), (grid_m, triton.cdiv(h, cfg.block_n)),
                     (inter_buf, slot_buffer, None, rows, *ids, num_pairs, intermediate, h, 2 * intermediate * h,
                      inter_buf.stride(0), slot_buffer.stride(0), rows.stride(0)))
        self.bound = None  # (gate_up, down) launches bound to this layer's arguments, after the first call

    def __call__(self, slot_of_expert: torch.Tensor) -> None:
        """The rows of every pair whose expert has a slot >= 0 in `slot_of_expert` [E] (other rows untouched)."""
        _check_slot_map(slot_of_expert, self.device)
        if self.empty:
            return
        if self.bound is not None:
            for run in self.bound:
                run(slot_of_expert)
            return
        bound = []
        for launch, grid, args in (self.gate_up, self.down):
            args = (*args[:2], slot_of_expert, *args[3:])  # the slot map is the third argument of both kernels
            launch(grid, *args, **self.constexprs)
            bound.append(launch.bound(grid, args, self.constexprs, varying=2))
        self.bound = tuple(bound)


def slot_moe_waves(hidden: torch.Tensor, top_k_index: torch.Tensor, slot_buffer: torch.Tensor, intermediate: int,
                   rows: torch.Tensor, alignment: Alignment, act: Callable | None = None,
                   workspace: MoEWorkspace | None = None, config: KernelConfig | None = None) -> SlotMoEWaves:
    """`slot_moe_rows` prepared for several slot maps over one routing: `waves(slot_of_expert)` per map, with
    `alignment` from `align_routing` (same config and routing)."""
    cfg = config or DEFAULT_CONFIG
    _check(hidden, top_k_index, slot_buffer, intermediate, rows, act, cfg)
    if alignment.block_m != cfg.block_m:
        raise ValueError(f"alignment has block_m={alignment.block_m}, the kernel config {cfg.block_m}")
    return SlotMoEWaves(hidden, top_k_index, slot_buffer, intermediate, rows, workspace, cfg, alignment,
                        alignment.num_padded)


def slot_moe_rows(hidden: torch.Tensor, top_k_index: torch.Tensor, slot_buffer: torch.Tensor,
                  slot_of_expert: torch.Tensor, intermediate: int, rows: torch.Tensor, act: Callable | None = None,
                  workspace: MoEWorkspace | None = None, config: KernelConfig | None = None,
                  alignment: Alignment | None = None) -> None:
    """rows[t*k + j] = expert_mlp(hidden[t]) (fp32, unweighted) for every pair whose expert has a slot >= 0.

    Other rows are untouched. Launches: a few torch ops for the alignment (none when `alignment`, from
    `align_routing` with the same config and routing, is given), one gate_up and one down GEMM; no host
    synchronisation (grid sizes are upper bounds; blocks past the used rows exit at once).
    """
    cfg = config or DEFAULT_CONFIG
    _check(hidden, top_k_index, slot_buffer, intermediate, rows, act, cfg)
    _check_slot_map(slot_of_expert, hidden.device)
    if top_k_index.numel() == 0:
        return
    if alignment is None:
        alignment, num_padded = _align(top_k_index, slot_of_expert, cfg.block_m, workspace)
    elif alignment.block_m != cfg.block_m:
        raise ValueError(f"alignment has block_m={alignment.block_m}, the kernel config {cfg.block_m}")
    else:
        num_padded = alignment.num_padded
    SlotMoEWaves(hidden, top_k_index, slot_buffer, intermediate, rows, workspace, cfg, alignment,
                 num_padded)(slot_of_expert)


def slot_moe_rows_reference(hidden: torch.Tensor, top_k_index: torch.Tensor, slot_buffer: torch.Tensor,
                            slot_of_expert: torch.Tensor, intermediate: int, rows: torch.Tensor,
                            act: Callable | None = None, workspace: MoEWorkspace | None = None,
                            config: KernelConfig | None = None, alignment: Alignment | None = None) -> None:
    """Plain torch, one GEMM pair per expert with a slot (host syncs); same contract as slot_moe_rows."""
    act = act or torch.nn.functional.silu
    k, flat = top_k_index.shape[1], top_k_index.reshape(-1)  # [T*k]
    for e, slot in enumerate(slot_of_expert.tolist()):
        pairs = (flat == e).nonzero().squeeze(1) if slot >= 0 else flat[:0]  # [n_e]
        if pairs.numel():
            gate_up, down = slot_views(slot_buffer, slot, intermediate)
            rows[pairs] = expert_mlp(hidden[pairs // k], gate_up, down, act).float()  # [n_e, H]
