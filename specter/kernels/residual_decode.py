"""Exact 16-bit expert weights from the draft's INT4 codes plus a residual blob (residual transfer), in Triton.

`decode_expert` is a pure tensor function: it writes an expert's flat weights (gate_up [2I, H], then down
[H, I]) from its blob (`specter.quant.residual_expert`) and the draft's packed codes and scales, with the
integer arithmetic of `specter.quant.residual.decode`; `decode_expert_reference` is its torch reference.
One program rebuilds a tile of BLOCK_ROWS output rows x one group of one linear, reading the codes and
scales in the draft's [in/8, out] and [in/g, out] layouts (coalesced along the rows). It computes each row's 16
code intervals once (low and width in one int32 per code, the zero point's folded one at code 8) and looks each
weight's up by its code, and it loads each row's group stream once and looks each weight's two words up in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specter.kernels.launch import CompiledLaunch
from specter.quant.int4 import Int4Linear
from specter.quant.residual import HALF, MARGIN_BASE, MARGIN_STEP, NO_FOLD, RAW_BITS, RAW_CLASS
from specter.quant.residual_expert import (  # noqa: F401
    ZERO_WIDTH_SHIFT,
    BlobLayout,
    decode_expert_reference,
    encode_expert,
)

BLOCK_ROWS = 16  # output rows a program decodes at once
NUM_WARPS = 4  # warps of a decode program
MIN_BLOCK_ROWS = 16  # an 8-row tile's gathers abort Triton 3.6's compile (an assertion in its gather lowering, H100)

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the module still imports; decode_expert raises RuntimeError
    triton = tl = None
    TRITON_AVAILABLE = False


if TRITON_AVAILABLE:
    _ZERO_WIDTH_SHIFT = tl.constexpr(ZERO_WIDTH_SHIFT)
    _CLASS_MASK = tl.constexpr((1 << ZERO_WIDTH_SHIFT) - 1)  # a class byte's margin class bits
    _NO_FOLD = tl.constexpr(NO_FOLD)
    _HALF = tl.constexpr(HALF)

    @triton.jit
    def _truncated_key(value, IS_BF16: tl.constexpr):
        """Order key of the 16-bit float nearest `value` (float32) toward zero (int32 arithmetic)."""
        b = value.to(tl.int32, bitcast=True)
        if IS_BF16:
            bits = (b >> 16) & 0xFFFF
        else:
            sign = (b >> 16) & 0x8000
            exponent = ((b >> 23) & 0xFF) - 127
            mantissa = b & 0x7FFFFF
            normal = ((exponent + 15) << 10) | (mantissa >> 13)
            sub_shift = tl.minimum(tl.maximum(-1 - exponent, 0), 31)
            subnormal = tl.minimum((mantissa | 0x800000) >> sub_shift, 0x3FF)
            magnitude = tl.where(exponent > 15, 0x7C00,
                                 tl.where(exponent >= -14, normal, tl.where(exponent >= -25, subnormal, 0)))
            bits = sign | magnitude
        return tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)

    @triton.jit
    def _bit_length(span):
        """Bits needed for 0..span (span < 2^24, int32): from the exponent of its float32 value."""
        exponent = (span.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        return tl.where(span > 0, exponent + 1, 0)

    @triton.jit
    def _scale_of(scales_ptr, offsets, mask, IS_BF16: tl.constexpr):
        """Float32 scales; bf16 arrives as its int16 pattern (widened by a shift, no float conversion)."""
        if IS_BF16:
            bits = tl.load(scales_ptr + offsets, mask=mask, other=0).to(tl.int32) & 0xFFFF
            return (bits << 16).to(tl.float32, bitcast=True)
        return tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _decode_tile(blob_ptr, count_ptr, class_ptr, out_ptr, qweight_ptr, scales_ptr, tile, out_features,
                     in_features, group_base, row_base, out_base, stream_word, blob_words,
                     MARGIN_BASE: tl.constexpr, MARGIN_STEP: tl.constexpr, RAW: tl.constexpr,
                     RAW_WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, IS_BF16: tl.constexpr):
        groups = in_features // GROUP
        group = tile % groups
        rows = (tile // groups) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
        row_ok = rows < out_features
        cols = group * GROUP + tl.arange(0, GROUP)  # [G]
        packed = tl.load(qweight_ptr + (cols // 8)[None, :] * out_features + rows[:, None], mask=row_ok[:, None],
                         other=0)  # [R, G], qweight [in/8, out]
        code = (packed >> ((cols % 8) * 4)[None, :]) & 0xF  # [R, G] in 0..15
        scale = _scale_of(scales_ptr, group * out_features + rows, row_ok, IS_BF16)[:, None]  # scales [in/g, out]
        index = group_base + rows * groups + group  # [R] the groups' indices in the blob
        class_byte = tl.load(class_ptr + index, mask=row_ok, other=RAW).to(tl.int32)[:, None]  # [R, 1]
        margin_class = class_byte & _CLASS_MASK
        zero_bits = class_byte >> _ZERO_WIDTH_SHIFT  # the group's zero width
        start = tl.load(blob_ptr + row_base + rows, mask=row_ok, other=0)  # [R] the rows' first words
        for before in range(group):  # plus the word counts of the row's groups before this one
            start += tl.load(count_ptr + index - group + before, mask=row_ok, other=0).to(tl.int32)
        start = start[:, None]
        margin = margin_class.to(tl.float32) * MARGIN_STEP + MARGIN_BASE  # residual.MARGINS, exact in float32
        q = (tl.arange(0, 16).to(tl.float32) - 8.0)[None, :]  # [1, 16]: each row's 16 intervals once
        low = tl.maximum(_truncated_key((q - 0.5 - margin) * scale, IS_BF16) - 1, 0)
        high = tl.minimum(_truncated_key((q + 0.5 + margin) * scale, IS_BF16) + 1, 0xFFFF)
        width = _bit_length(tl.maximum(high - low, 0))  # [R, 16]
        # the zero point's interval, folded at zero (residual.fold_zero_point): one per row, [R, 1]
        zero_high = tl.minimum(_truncated_key((0.5 + margin) * scale, IS_BF16) + 1, 0xFFFF)
        zero_low = tl.maximum(zero_high - (1 << tl.maximum(zero_bits - 1, 0)) + 1, _HALF)
        fold = tl.where(code == 8, tl.maximum(zero_high - zero_low + 1, 0), _NO_FOLD)  # [R, G]
        at_zero = q == 0.0  # [1, 16]: code 8's entry is the zero point's interval
        table = tl.where(at_zero, zero_low, low) | (tl.where(at_zero, zero_bits, width) << 16)  # [R, 16]
        entry = tl.gather(table, code, axis=1)  # [R, G]: low (16 bits) and width above it, one lookup
        low, width = entry & 0xFFFF, entry >> 16
        raw = margin_class == RAW
        width = tl.where(raw, RAW_WIDTH, width)  # [R, G]
        within = tl.cumsum(width, axis=1) - width  # bit offset inside the group
        shift = (within & 31).to(tl.uint32)
        first = within >> 5  # [R, G], below GROUP/2
        span = stream_word + start + tl.arange(0, GROUP * RAW_WIDTH // 32)[None, :]  # [R, GROUP/2]
        block = tl.load(blob_ptr + span, mask=row_ok[:, None] & (span < blob_words), other=0)  # the group streams
        w0 = tl.gather(block, first, axis=1).to(tl.uint32, bitcast=True)
        # a weight in the group's last word ends in it: its next word, clamped, is masked off below
        last = GROUP * RAW_WIDTH // 32 - 1
        w1 = tl.gather(block, tl.minimum(first + 1, last), axis=1).to(tl.uint32, bitcast=True)
        pair = (w0 >> shift) | ((w1 << 1) << (31 - shift))  # the 32 bits from the weight's offset
        value = (pair & ((tl.full([BLOCK_ROWS, GROUP], 1, tl.uint32) << width.to(tl.uint32)) - 1)).to(tl.int32)
        key = tl.where(value >= fold, 0xFFFF - (low + value - fold), low + value)
        bits = tl.where(raw, value, tl.where(key >= 0x8000, key & 0x7FFF, 0xFFFF - key))
        tl.store(out_ptr + out_base + rows[:, None] * in_features + cols[None, :], bits.to(tl.int16),  # low 16 bits
                 mask=row_ok[:, None])

    @triton.jit
    def _decode_expert_tile(blob_ptr, out_ptr, qweight0_ptr, scales0_ptr, qweight1_ptr, scales1_ptr,
                            out0, in0, out1, in1, tiles0, group_base1, out_base1, stream_word, count_byte,
                            class_byte, blob_words, MARGIN_BASE: tl.constexpr, MARGIN_STEP: tl.constexpr,
                            RAW: tl.constexpr, RAW_WIDTH: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, IS_BF16: tl.constexpr):
        """This program's tile (program_id(0)) of one expert."""
        count_ptr = blob_ptr.to(tl.pointer_type(tl.uint8)) + count_byte  # the groups' word counts, a byte each
        class_ptr = blob_ptr.to(tl.pointer_type(tl.uint8)) + class_byte  # the margin classes, a byte each
        bits_ptr = out_ptr.to(tl.pointer_type(tl.int16))  # the 16-bit patterns of the weights
        tile = tl.program_id(0)
        if tile < tiles0:  # linear 0 (gate_up)
            _decode_tile(blob_ptr, count_ptr, class_ptr, bits_ptr, qweight0_ptr, scales0_ptr, tile, out0, in0,
                         0, 0, 0, stream_word, blob_words, MARGIN_BASE, MARGIN_STEP, RAW, RAW_WIDTH, GROUP,
                         BLOCK_ROWS, IS_BF16)
        else:  # linear 1 (down)
            _decode_tile(blob_ptr, count_ptr, class_ptr, bits_ptr, qweight1_ptr, scales1_ptr, tile - tiles0, out1,
                         in1, group_base1, out0, out_base1, stream_word, blob_words, MARGIN_BASE, MARGIN_STEP, RAW,
                         RAW_WIDTH, GROUP, BLOCK_ROWS, IS_BF16)

    @triton.jit(do_not_specialize=["blob_words"])  # one compiled kernel for every blob length
    def _residual_decode_kernel(
        blob_ptr, out_ptr, qweight0_ptr, scales0_ptr, qweight1_ptr, scales1_ptr,
        out0, in0, out1, in1, tiles0, group_base1, out_base1, stream_word, count_byte, class_byte, blob_words,
        MARGIN_BASE: tl.constexpr, MARGIN_STEP: tl.constexpr, RAW: tl.constexpr,
        RAW_WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, IS_BF16: tl.constexpr,
    ):
        _decode_expert_tile(blob_ptr, out_ptr, qweight0_ptr, scales0_ptr, qweight1_ptr, scales1_ptr,
                            out0, in0, out1, in1, tiles0, group_base1, out_base1, stream_word, count_byte,
                            class_byte, blob_words, MARGIN_BASE, MARGIN_STEP, RAW, RAW_WIDTH, GROUP, BLOCK_ROWS,
                            IS_BF16)

    @triton.jit
    def _residual_decode_group_kernel(
        staging_ptr, pool_ptr, items_ptr, qweight0_ptr, scales0_ptr, qweight1_ptr, scales1_ptr,
        qweight0_stride, scales0_stride, qweight1_stride, scales1_stride,
        out0, in0, out1, in1, tiles0, group_base1, out_base1, stream_word, count_byte, class_byte,
        MARGIN_BASE: tl.constexpr, MARGIN_STEP: tl.constexpr, RAW: tl.constexpr,
        RAW_WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, IS_BF16: tl.constexpr,
    ):
        """Several experts of one layer, one per program_id(1): items [n, 4] int64 holds each one's blob offset
        in `staging` (words), blob length (words), expert index into the layer's stacked drafts, and output
        offset in `pool` (elements)."""
        item = items_ptr + tl.program_id(1) * 4
        blob_offset, blob_words = tl.load(item), tl.load(item + 1)
        expert, out_offset = tl.load(item + 2), tl.load(item + 3)
        _decode_expert_tile(staging_ptr + blob_offset, pool_ptr + out_offset, qweight0_ptr + expert * qweight0_stride,
                            scales0_ptr + expert * scales0_stride, qweight1_ptr + expert * qweight1_stride,
                            scales1_ptr + expert * scales1_stride, out0, in0, out1, in1, tiles0, group_base1,
                            out_base1, stream_word, count_byte, class_byte, blob_words, MARGIN_BASE, MARGIN_STEP, RAW,
                            RAW_WIDTH, GROUP, BLOCK_ROWS, IS_BF16)


@dataclass(frozen=True)
class DecodePlan:
    """What every decode launch of one model's experts shares: the grid (a program per tile of BLOCK_ROWS output
    rows x one group of one linear) and the blob layout's integers."""

    grid: tuple[int]
    layout_args: tuple[int, ...]  # out0, in0, out1, in1, tiles0, group_base1, out_base1, stream_word, count_byte,
    # class_byte
    group_size: int
    is_bf16: bool
    block_rows: int = BLOCK_ROWS
    num_warps: int = NUM_WARPS

    @classmethod
    def of(cls, layout: BlobLayout, dtype: torch.dtype, block_rows: int = BLOCK_ROWS,
           num_warps: int = NUM_WARPS) -> DecodePlan:
        """The plan of `layout`'s experts in `dtype` (the tile and warps: the defaults unless a sweep sets them)."""
        if len(layout.shapes) != 2:
            raise ValueError("the residual decode kernel takes an expert's two linears (gate_up, down)")
        if block_rows < MIN_BLOCK_ROWS or block_rows & (block_rows - 1):
            raise ValueError(f"block_rows must be a power of two >= {MIN_BLOCK_ROWS} (Triton 3.6's gather lowering "
                             f"aborts the compile on smaller tiles), got {block_rows}")
        tiles = [_cdiv(o, block_rows) * (i // layout.group_size) for o, i in layout.shapes]
        args = (*layout.shapes[0], *layout.shapes[1], tiles[0], layout.group_base(1), layout.output_base(1),
                layout.stream_word, 4 * layout.count_word, 4 * layout.class_word)
        return cls((sum(tiles),), args, layout.group_size, dtype == torch.bfloat16, block_rows, num_warps)

    @property
    def constants(self) -> dict:
        """The kernels' compile-time arguments and launch options."""
        return dict(MARGIN_BASE=MARGIN_BASE, MARGIN_STEP=MARGIN_STEP, RAW=RAW_CLASS, RAW_WIDTH=RAW_BITS,
                    GROUP=self.group_size, BLOCK_ROWS=self.block_rows, IS_BF16=self.is_bf16,
                    num_warps=self.num_warps)


def expert_operands(drafts: list[Int4Linear], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(qweight0, scales0, qweight1, scales1) of an expert's drafts (or of a layer's stacked [E, ...] drafts)
    as the kernel reads them: scales in the weights' `dtype` (as the reference rounds them), bf16 ones as
    their int16 patterns."""
    operands = []
    for draft in drafts:
        scales = draft.scales if draft.scales.dtype == dtype else draft.scales.to(dtype)
        operands += [draft.qweight, scales.view(torch.int16) if dtype == torch.bfloat16 else scales]
    return tuple(operands)


def launch_decode(plan: DecodePlan, operands: tuple[torch.Tensor, ...], blob: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """One decode launch on the current stream through Triton's JIT (`decode_expert` with its plan and
    operands prepared; `DecodeLauncher` is the same launch with less host time). Returns `out`."""
    _residual_decode_kernel[plan.grid](blob, out, *operands, *plan.layout_args, blob.numel(), **plan.constants)
    return out


class DecodeLauncher:
    """The decode launches of one plan, with little host time per launch (a cache load makes one each, or
    a group of loads one): through `CompiledLaunch`, the blob length left out of the signature (the kernel
    does not specialise it), so one compiled kernel serves every expert."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.launch = CompiledLaunch(_residual_decode_kernel)
        self.group_launch = CompiledLaunch(_residual_decode_group_kernel)
        self.bound_groups, self.bound_buffers = {}, None  # (layer operands, group size) -> bound launch; buffers
        self.constants = plan.constants

    def __call__(self, operands: tuple[torch.Tensor, ...], blob: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.launch(self.plan.grid, blob, out, *operands, *self.plan.layout_args, blob.numel(), **self.constants)
        return out

    def group(self, layer_operands: tuple[torch.Tensor, ...], staging: torch.Tensor, pool: torch.Tensor,
              items: torch.Tensor) -> None:
        """Several experts of one layer in one launch (`decode_experts`), on the current stream: after the first
        launch of a layer's group size into `staging` and `pool`, straight through the compiled launcher with
        only `items` new (`CompiledLaunch.bound`; launches into other buffers forget the bound ones)."""
        buffers = (staging.data_ptr(), pool.data_ptr())
        if buffers != self.bound_buffers:
            self.bound_groups, self.bound_buffers = {}, buffers
        key = (id(layer_operands), items.shape[0])
        run = self.bound_groups.get(key)
        if run is not None:
            run(items)
            return
        strides = tuple(operand.stride(0) for operand in layer_operands)  # one expert's step in each [E, ...]
        grid, args = (self.plan.grid[0], items.shape[0]), (staging, pool, items, *layer_operands, *strides,
                                                           *self.plan.layout_args)
        self.group_launch(grid, *args, **self.constants)
        self.bound_groups[key] = self.group_launch.bound(grid, args, self.constants, varying=2)

    def unbind(self) -> None:
        """Forget the bound group launches (they hold the staging and pool tensors)."""
        self.bound_groups, self.bound_buffers = {}, None


def group_rows(items: list[tuple], pool: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """`decode_experts`' items as rows of four ints (blob offset, blob words, expert, output offset) from loads
    given as (blob offset in the staging buffer's words, blob words, destination row: a view into `pool`,
    expert)."""
    base, width = pool.data_ptr(), pool.element_size()
    return [(offset, words, expert, (dst.data_ptr() - base) // width) for offset, words, dst, expert in items]


def group_table(items: list[tuple], pool: torch.Tensor) -> torch.Tensor:
    """`group_rows` as the [n, 4] int64 host tensor `decode_experts` takes (once on the device)."""
    return torch.tensor(group_rows(items, pool), dtype=torch.int64).view(len(items), 4)


def decode_experts(staging: torch.Tensor, pool: torch.Tensor, items: torch.Tensor, layout: BlobLayout,
                   layer_drafts: list[Int4Linear]) -> torch.Tensor:
    """Several experts of one layer at once: for each row (blob offset in `staging` (int32 words), blob
    words, expert, output offset in `pool` (elements)) of `items` [n, 4] int64 (on the device), the expert's
    exact weights into `pool` (16-bit, flat) from its blob in `staging` and its layer's stacked drafts
    (qweight [E, in/8, out], scales [E, in/g, out]); one launch on the current stream. Returns `pool`."""
    launcher = DecodeLauncher(DecodePlan.of(layout, pool.dtype))
    launcher.group(expert_operands(layer_drafts, pool.dtype), staging, pool, items)
    return pool


def decode_expert(blob: torch.Tensor, layout: BlobLayout, drafts: list[Int4Linear], out: torch.Tensor) -> torch.Tensor:
    """Write the expert's exact weights into `out` (flat, 16-bit, sum(out * in) elements: gate_up then down)
    from `blob` (int32, on the device) and its linears' drafts (qweight [in/8, out], scales [in/g, out], as
    stored); one launch on the current stream. Returns `out`."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("decode_expert needs Triton; decode_expert_reference is the torch reference")
    plan = DecodePlan.of(layout, out.dtype)
    return launch_decode(plan, expert_operands(drafts, out.dtype), blob, out)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
