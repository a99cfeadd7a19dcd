"""Expert alignment of routed (token, slot) pairs: sorted by expert, each expert padded to block_m rows."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from specter.kernels.launch import CompiledLaunch

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    triton = tl = None
    TRITON_AVAILABLE = False

MAX_ONE_LAUNCH = 16384  # pairs x experts (both padded to powers of two) one program handles in registers


class MoEWorkspace:
    """Reusable intermediate buffers, keyed by (name, dtype, device) and grown on demand; one per stream.
    Also each kernel's `CompiledLaunch` (the host-cheap launches of its compiled kernels).

    `one_launch`: the one-launch alignment kernel may be tried (False once this Triton failed to compile it).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._launches: dict = {}
        self.one_launch = True

    def launch(self, kernel) -> CompiledLaunch:
        """The kernel's launches through its compiled kernels (`specter.kernels.launch`), kept here."""
        found = self._launches.get(kernel)
        if found is None:
            found = self._launches[kernel] = CompiledLaunch(kernel)
        return found

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        key = (name, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def compiled_kernels(self) -> int:
        """Compiled kernels its launches have gone through (one per specialisation; 0 under the interpreter)."""
        return sum(len(launch.compiled) for launch in self._launches.values())

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def compiled_launch(workspace: MoEWorkspace | None, kernel) -> CompiledLaunch:
    """`workspace`'s launches of `kernel` (a fresh CompiledLaunch, which goes through the JIT, without one)."""
    return CompiledLaunch(kernel) if workspace is None else workspace.launch(kernel)


def scratch(workspace: MoEWorkspace | None, name, shape, dtype, device) -> torch.Tensor:
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.get(name, shape, dtype, device)


@dataclass
class Alignment:
    """(token, slot) pairs sorted by expert, each expert's segment padded to a multiple of block_m."""

    sorted_pair_ids: torch.Tensor  # [max_padded] int64, pair = token * k + slot; padding = T*k (sentinel)
    expert_ids: torch.Tensor  # [max_padded / block_m] int64, the expert of each M-block
    num_padded: torch.Tensor  # [1] int64, rows in use (blocks past it exit at once)
    padded_counts: torch.Tensor  # [E] int64, padded rows per expert
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on M-blocks without reading the counts (no host sync): every expert that can have
    tokens adds at most block_m - 1 rows of padding."""
    active = min(num_pairs, num_experts)
    return -(-(num_pairs + active * (block_m - 1)) // block_m)


def moe_align_block_size(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                         workspace: MoEWorkspace | None = None) -> Alignment:
    """Sort-and-pad of the [T, k] routing on the device, no host sync: one Triton launch when it fits
    one program (CUDA, or the interpreter), else a sequence of torch ops (`moe_align_torch`)."""
    pairs, experts = _pow2(top_k_index.numel()), _pow2(num_experts)
    compiled = top_k_index.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    allowed = workspace is None or workspace.one_launch
    if TRITON_AVAILABLE and compiled and pairs * experts <= MAX_ONE_LAUNCH and allowed:
        try:
            return moe_align_triton(top_k_index, num_experts, block_m, workspace)
        except Exception as err:  # a Triton build that cannot compile it: say so, keep decoding
            _disable_one_launch(err, workspace)
    return moe_align_torch(top_k_index, num_experts, block_m, workspace)


def _disable_one_launch(err: Exception, workspace: MoEWorkspace | None) -> None:
    """No more one-launch alignments with `workspace` (its owner's kernels use the torch alignment)."""
    if workspace is not None:
        workspace.one_launch = False
    warnings.warn(f"one-launch expert alignment failed ({type(err).__name__}: {str(err).splitlines()[0][:160]}); "
                  "using the torch alignment", RuntimeWarning, stacklevel=3)


def moe_align_torch(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                    workspace: MoEWorkspace | None = None) -> Alignment:
    """The alignment in plain torch ops (the reference, and the path for large T*k x E)."""
    flat = top_k_index.reshape(-1).long()  # [P], P = T*k
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pair ids, grouped by expert, token order kept
    expert_of = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]  # [P]
    dest = padded_end[expert_of] - padded[expert_of] + rank  # [P] row in the padded layout
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = scratch(workspace, "sorted_ids", (blocks * block_m,), torch.long, device)
    sorted_ids.fill_(num_pairs).scatter_(0, dest, order)  # [max_padded]
    block_start = torch.arange(blocks, device=device) * block_m  # [max_blocks]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return Alignment(sorted_ids, expert_ids, padded_end[-1:], padded, block_m)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n)) if TRITON_AVAILABLE else n


def one_launch_blocks(num_experts: int, block_m: int) -> tuple[int, int, int]:
    """The one-launch kernel's (P, E, B) register blocks for `num_experts`: the most pairs one program handles
    at this E, whatever the routing's own count, so that every window length runs one compiled kernel (a
    per-count block would compile once per power of two, mid-decode)."""
    experts = _pow2(num_experts)
    pairs = MAX_ONE_LAUNCH // experts
    return pairs, experts, _pow2(max_blocks(pairs, num_experts, block_m))


if TRITON_AVAILABLE:

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one compiled kernel for every window length
    def _align_kernel(
        ids_ptr, sorted_ptr, expert_ids_ptr, padded_ptr, num_padded_ptr,  # ids [P]; outputs, all int64
        num_pairs, num_experts, num_blocks,
        BLOCK_M: tl.constexpr, P: tl.constexpr, E: tl.constexpr, B: tl.constexpr, R: tl.constexpr,
    ):
        """One program: counts per expert, padded segment starts, each pair's row, each block's expert."""
        offs_p = tl.arange(0, P)
        offs_e = tl.arange(0, E)
        in_pairs, in_experts = offs_p < num_pairs, offs_e < num_experts
        ids = tl.load(ids_ptr + offs_p, mask=in_pairs, other=-1)  # [P]; padding matches no expert
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [P, E]
        counts = tl.sum(onehot, axis=0)  # [E]
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E]
        padded_end = tl.cumsum(padded, axis=0)  # [E]
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # [P] same-expert pairs before
        dest = tl.sum(onehot * (padded_end - padded)[None, :], axis=1) + rank  # [P] row in the padded layout
        rows = num_blocks * BLOCK_M
        for r0 in range(0, rows, R):  # every row starts as padding (the sentinel num_pairs)
            offs_r = r0 + tl.arange(0, R)
            tl.store(sorted_ptr + offs_r, tl.full((R,), 0, tl.int64) + num_pairs, mask=offs_r < rows)
        tl.debug_barrier()
        tl.store(sorted_ptr + dest, offs_p.to(tl.int64), mask=in_pairs)
        offs_b = tl.arange(0, B)
        ends = tl.where(in_experts, padded_end, 2147483647)  # lanes past E never count
        expert = tl.sum((ends[None, :] <= (offs_b * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [B]
        tl.store(expert_ids_ptr + offs_b, tl.minimum(expert, num_experts - 1).to(tl.int64), mask=offs_b < num_blocks)
        tl.store(padded_ptr + offs_e, padded.to(tl.int64), mask=in_experts)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0).to(tl.int64))


def moe_align_triton(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                     workspace: MoEWorkspace | None = None) -> Alignment:
    """The alignment as one single-program Triton launch (for pairs x experts <= MAX_ONE_LAUNCH)."""
    flat = top_k_index.reshape(-1)  # [P]
    num_pairs, device = flat.numel(), flat.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = scratch(workspace, "sorted_ids", (blocks * block_m,), torch.long, device)
    expert_ids = torch.empty(blocks, dtype=torch.long, device=device)
    padded = torch.empty(num_experts, dtype=torch.long, device=device)
    num_padded = torch.empty(1, dtype=torch.long, device=device)
    pairs_block, experts_block, blocks_block = one_launch_blocks(num_experts, block_m)
    compiled_launch(workspace, _align_kernel)(
        (1,), flat, sorted_ids, expert_ids, padded, num_padded, num_pairs, num_experts, blocks, BLOCK_M=block_m,
        P=pairs_block, E=experts_block, B=blocks_block, R=256, num_warps=8)
    return Alignment(sorted_ids, expert_ids, num_padded, padded, block_m)
