"""Exact 16-bit expert weights from the draft's INT4 codes plus residual bits (residual transfer), in Triton.

`decode_rows` is a pure tensor function: one program per (output row, group) rebuilds that group's
weights from the packed codes, the float32 scales, the group's margin class and word start, and the
uint32 stream, with the same integer arithmetic as `specter.quant.residual.decode` (its torch reference).
"""
from __future__ import annotations

import torch

from specter.quant.int4 import unpack_codes
from specter.quant.residual import MARGINS, RAW_CLASS, ResidualTensor
from specter.quant.residual import decode as decode_reference

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the module still imports; decode_rows raises RuntimeError
    triton = tl = None
    TRITON_AVAILABLE = False


if TRITON_AVAILABLE:

    @triton.jit
    def _truncated_key(value, IS_BF16: tl.constexpr):
        """Order key of the 16-bit float nearest `value` (float32) toward zero (integer arithmetic)."""
        b = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        if IS_BF16:
            bits = b >> 16
        else:
            sign = (b >> 16) & 0x8000
            exponent = ((b >> 23) & 0xFF) - 127
            mantissa = b & 0x7FFFFF
            normal = ((exponent + 15) << 10) | (mantissa >> 13)
            sub_shift = tl.minimum(tl.maximum(-1 - exponent, 0), 63)
            subnormal = tl.minimum((mantissa | 0x800000) >> sub_shift, 0x3FF)
            magnitude = tl.where(exponent > 15, 0x7C00,
                                 tl.where(exponent >= -14, normal, tl.where(exponent >= -25, subnormal, 0)))
            bits = sign | magnitude
        return tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)

    @triton.jit
    def _residual_decode_kernel(
        qweight_ptr, scales_ptr, class_ptr, start_ptr, words_ptr, out_ptr,  # see decode_rows
        out_features, groups, num_words,
        M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr, RAW: tl.constexpr,
        GROUP: tl.constexpr, IS_BF16: tl.constexpr,
    ):
        row = tl.program_id(0)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)  # [G] input columns
        packed = tl.load(qweight_ptr + (cols // 8) * out_features + row)  # qweight [in/8, out]
        q = ((packed >> ((cols % 8) * 4)) & 0xF).to(tl.float32) - 8.0
        scale = tl.load(scales_ptr + row * groups + group)
        margin_class = tl.load(class_ptr + row * groups + group).to(tl.int32)
        margin = tl.where(margin_class == 0, M0, tl.where(margin_class == 1, M1, tl.where(margin_class == 2, M2, M3)))
        low = tl.maximum(_truncated_key((q - 0.5 - margin) * scale, IS_BF16) - 1, 0)
        high = tl.minimum(_truncated_key((q + 0.5 + margin) * scale, IS_BF16) + 1, 0xFFFF)
        span = tl.maximum(high - low, 0)
        width = tl.zeros([GROUP], dtype=tl.int64)
        for k in tl.static_range(16):  # bit length of span (< 2^16)
            width += ((span >> k) > 0).to(tl.int64)
        raw = margin_class == RAW
        width = tl.where(raw, 16, width)  # residual.RAW_BITS
        offset = tl.load(start_ptr + row * groups + group) * 32 + tl.cumsum(width, 0) - width  # [G] bit offsets
        word = offset >> 5
        w0 = tl.load(words_ptr + word, mask=word < num_words, other=0).to(tl.int64) & 0xFFFFFFFF
        w1 = tl.load(words_ptr + word + 1, mask=word + 1 < num_words, other=0).to(tl.int64) & 0xFFFFFFFF
        value = ((w0 | (w1 << 32)) >> (offset & 31)) & ((tl.full([GROUP], 1, tl.int64) << width) - 1)
        key = low + value
        bits = tl.where(raw, value, tl.where(key >= 0x8000, key & 0x7FFF, 0xFFFF - key))
        bits = tl.where(bits >= 0x8000, bits - 0x10000, bits)  # the int16 pattern
        tl.store(out_ptr + row * (groups * GROUP) + cols, bits.to(tl.int16))


def stream_as_int32(words: torch.Tensor) -> torch.Tensor:
    """The uint32 stream (held in int64) as int32 bit patterns, the kernel's input."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def decode_rows(encoded: ResidualTensor, qweight: torch.Tensor, scales: torch.Tensor,
                words: torch.Tensor | None = None) -> torch.Tensor:
    """W [out, in] of one linear, bit-exact: qweight [in/8, out] int32 (the draft's packed codes), scales
    [out, in/g] (float32, or the stored dtype), `encoded` its residuals (`words`: the stream as int32 on
    the device, default: converted from `encoded.words`)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("decode_rows needs Triton; specter.quant.residual.decode is the torch reference")
    out_features, groups = encoded.margin_class.shape
    device = qweight.device
    words = stream_as_int32(encoded.words).to(device) if words is None else words
    words = words if words.numel() else torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty(out_features, groups * encoded.group_size, dtype=torch.int16, device=device)
    _residual_decode_kernel[(out_features, groups)](
        qweight.contiguous(), scales.to(encoded.dtype).to(device=device, dtype=torch.float32).contiguous(),
        encoded.margin_class.to(device).contiguous(), encoded.word_start.to(device).contiguous(), words, out,
        out_features, groups, words.numel(), *MARGINS, RAW_CLASS, encoded.group_size,
        encoded.dtype == torch.bfloat16)
    return out.view(encoded.dtype)


def decode_rows_reference(encoded: ResidualTensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The torch reference of `decode_rows` (same inputs)."""
    return decode_reference(encoded, unpack_codes(qweight.cpu()), scales.cpu())
