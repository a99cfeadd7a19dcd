"""Lossless residual of a 16-bit weight given its INT4 draft code: the bits that must cross PCIe.

A weight w with draft code q and group scale s (round-to-nearest) lies in [s(q - 1/2), s(q + 1/2)]. In
the total order of 16-bit floats (`order_keys`: monotone, -0 below +0) that interval spans
2^width(q) values at most, so w is sent as its key minus the interval's lowest key, in width(q) bits.
Both sides derive the interval from the stored code and the stored scale alone, in float32 arithmetic
that rounds the same way everywhere (one multiply of exact operands, then an integer truncation to 16
bits and one step outward), so no per-weight side information travels. Each group (one output row's
`group_size` inputs) widens its intervals by the smallest of MARGINS (scale units per side) that holds
all its weights: 1/64 covers round-to-nearest codes (rounded against the float32 scale before it was
stored in 16 bits); GPTQ codes, where |w/s - q| can exceed 1/2, need wider ones, in steps of 11/32 of a
scale up to 2.08 (each doubling of the interval costs about one bit, so steps finer than a doubling let
a group pay for the spread it has). A group that no margin covers (NaN, infinity, codes of another
tensor) is sent raw, 16 bits per weight.

A zero-point weight (q = 0) has the interval [-(1/2 + m)s, (1/2 + m)s], which runs through every binade
down to zero (about 15 bits wide), while the weights themselves sit in its top binades. Its interval is
folded at zero: a negative weight's key is mirrored (0xFFFF - key) onto its magnitude's, and only the top
2^(z - 1) magnitude keys below the interval's high bound are kept, where z, the group's zero width, is the
fewest bits that hold all of the group's zero-point weights (`fold_zero_point`); the residual is the
magnitude's offset in that range, plus the range's size for a negative weight, in z bits.

Layout of an encoded tensor W [..., out, in] (leading dims: experts): per group its margin class (3
bits; RAW_CLASS = raw), its zero width (5 bits) and the start of its bits in a uint32 word stream (each
group starts on a word); within a group the weights' residuals follow in input order, each in its own
width. `encode` and `decode` are the plain torch reference of the format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specter.quant.int4 import ZERO_POINT

MARGIN_BASE, MARGIN_STEP = 1.0 / 64, 11.0 / 32  # class k widens by MARGIN_BASE + k MARGIN_STEP (exact in float32)
MARGINS = tuple(MARGIN_BASE + k * MARGIN_STEP for k in range(7))  # per side, in scale units
RAW_CLASS = len(MARGINS)  # 7: the margin class takes 3 bits
RAW_BITS = 16
WORD = 32
NO_FOLD = 1 << RAW_BITS  # the fold of a weight whose interval is not folded: no residual reaches it
HALF = 0x8000  # the key of +0: keys from here up are positive floats


@dataclass
class ResidualTensor:
    """The residual encoding of W [..., out, in] (16-bit) against its INT4 codes and scales.

    margin_class: [..., out, in/g] uint8, the index into MARGINS of each group (RAW_CLASS: sent as its
    16-bit patterns); zero_width: [..., out, in/g] uint8, the bits of each group's zero-point weights
    (0 where it has none); word_start: [..., out, in/g] int64, the group's first word in `words`; words: [N]
    int64 holding uint32 values (the bit stream).
    """

    margin_class: torch.Tensor
    zero_width: torch.Tensor
    word_start: torch.Tensor
    words: torch.Tensor
    dtype: torch.dtype
    group_size: int

    def nbytes(self) -> int:
        """Bytes that cross PCIe in an expert's blob (`residual_expert`): the stream (4 bytes a word), per group
        its word count and its byte of margin class and zero width, per output row its int32 word start."""
        rows = self.margin_class.numel() // max(self.margin_class.shape[-1], 1)
        return self.words.numel() * 4 + self.margin_class.numel() * 2 + rows * 4

    @property
    def raw(self) -> torch.Tensor:
        return self.margin_class == RAW_CLASS


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit pattern of a float16/bfloat16 tensor as int32 in [0, 65535]."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"residual transfer needs a 16-bit float tensor, got {x.dtype}")
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def order_keys(bits: torch.Tensor) -> torch.Tensor:
    """Monotone int32 keys of 16-bit float patterns: negative values reversed below 0x8000, -0 just
    below +0 (NaN patterns land beyond the infinities)."""
    return torch.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)


def keys_to_bits(keys: torch.Tensor) -> torch.Tensor:
    return torch.where(keys >= 0x8000, keys & 0x7FFF, 0xFFFF - keys)


def truncated_bits(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns of float32 values rounded toward zero, in integer arithmetic alone (the GPU kernel
    does the same operations, so both ends agree bit for bit): bf16 keeps the upper half of the float32
    pattern; fp16 rebiases the exponent (subnormals shifted in, overflow to infinity)."""
    b = value.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if dtype == torch.bfloat16:
        return (b >> 16).to(torch.int32)
    sign = (b >> 16) & 0x8000
    exponent = ((b >> 23) & 0xFF) - 127  # unbiased
    mantissa = b & 0x7FFFFF
    normal = ((exponent + 15) << 10) | (mantissa >> 13)
    sub_shift = (-1 - exponent).clamp(0, 63)  # value < 2^-14: fp16 subnormal m * 2^-24
    subnormal = ((mantissa | 0x800000) >> sub_shift).clamp_max(0x3FF)
    magnitude = torch.where(exponent > 15, torch.full_like(b, 0x7C00),
                            torch.where(exponent >= -14, normal,
                                        torch.where(exponent >= -25, subnormal, torch.zeros_like(b))))
    return (sign | magnitude).to(torch.int32)


def bound_key(value: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """A key at or below (`up`: at or above) every 16-bit float within one step of `value`: the key of
    its truncation toward zero, moved one step outward (a conservative, exactly reproducible bound)."""
    keys = order_keys(truncated_bits(value, dtype))
    return (keys + 1).clamp_max(0xFFFF) if up else (keys - 1).clamp_min(0)


def intervals(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, group_size: int,
              margin: torch.Tensor, zero_width: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lowest key, width in bits, fold) of every weight's interval, from codes [..., out, in] (uint8, 0..15),
    scales [..., out, in/g] (as stored), the margin of each group [..., out, in/g] (float32) and its zero
    width ([..., out, in/g]; None: the whole folded interval). fold is NO_FOLD except for zero-point weights
    (`fold_zero_point`)."""
    q = codes.to(torch.float32) - ZERO_POINT  # [..., out, in]
    s = scales.to(dtype).float().repeat_interleave(group_size, dim=-1)  # [..., out, in]
    m = margin.to(torch.float32).repeat_interleave(group_size, dim=-1)
    low = bound_key((q - 0.5 - m) * s, dtype, up=False)  # q - 0.5 - m is exact in float32
    high = bound_key((q + 0.5 + m) * s, dtype, up=True)
    span = (high - low).clamp_min(0)  # keys low .. high: span + 1 values
    width = bit_length(span).clamp(0, RAW_BITS)
    zero = q == 0
    if zero_width is None:
        zero_bits = full_zero_width(high)
    else:
        zero_bits = zero_width.to(torch.int32).repeat_interleave(group_size, dim=-1)
    zero_low, fold = fold_zero_point(high, zero_bits)
    return (torch.where(zero, zero_low, low), torch.where(zero, zero_bits, width),
            torch.where(zero, fold, torch.full_like(fold, NO_FOLD)))


def full_zero_width(high: torch.Tensor) -> torch.Tensor:
    """The zero width that holds every key of a zero-point interval with high bound `high`: +0 .. high
    and their mirrors (the unfolded interval's width)."""
    return bit_length((2 * (high - HALF) + 1).clamp_min(0)).clamp(0, RAW_BITS)


def fold_zero_point(high: torch.Tensor, zero_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, fold) of zero-point weights sent in `zero_bits` bits: their magnitudes' keys low .. high (the top
    2^(zero_bits - 1) positive keys, none below +0), a positive weight as key - low and a negative one as
    fold + mirrored key - low, where fold = high - low + 1 (so every residual is below 2^zero_bits)."""
    low = (high - (1 << (zero_bits - 1).clamp_min(0)) + 1).clamp_min(HALF)
    return low, (high - low + 1).clamp_min(0)


def magnitude_keys(keys: torch.Tensor) -> torch.Tensor:
    """Keys with negative ones mirrored onto their magnitude's (0xFFFF - key), so -x and x share a key."""
    return torch.where(keys < HALF, 0xFFFF - keys, keys)


def fold_residuals(keys: torch.Tensor, low: torch.Tensor, width: torch.Tensor,
                   fold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, fits) of keys in their intervals (`intervals`): key - low, or for a folded interval the
    magnitude's offset (plus fold for a negative key); fits says whether the interval holds the key."""
    mirrored = (fold < NO_FOLD) & (keys < HALF)
    offset = torch.where(mirrored, magnitude_keys(keys), keys) - low
    limit = torch.where(fold < NO_FOLD, fold, 1 << width.to(torch.int64))
    return torch.where(mirrored, offset + fold, offset), (offset >= 0) & (offset < limit)


def unfold_keys(value: torch.Tensor, low: torch.Tensor, fold: torch.Tensor) -> torch.Tensor:
    """The keys of residuals (`fold_residuals`' inverse)."""
    return torch.where(value >= fold, 0xFFFF - (low + value - fold), low + value)


def narrow_zero_width(keys: torch.Tensor, codes: torch.Tensor, low: torch.Tensor, fold: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """Each group's zero width [..., out, in/g] (uint8): the fewest bits that hold its zero-point weights,
    given their whole folded intervals (low, fold of `intervals` without a zero width; 0: no such weight)."""
    zero = codes.to(torch.int32) == ZERO_POINT
    offset = magnitude_keys(keys) - low  # from +0, [..., out, in]
    needed = torch.where(zero, fold - offset, torch.zeros_like(offset))  # keys from the weight's up to high
    needed = needed.unflatten(-1, (-1, group_size)).amax(-1)  # [..., out, in/g]
    return bit_length((2 * needed - 1).clamp_min(0)).to(torch.uint8)


def bit_length(span: torch.Tensor) -> torch.Tensor:
    """Bits needed for 0..span (int32 span < 2^24), exactly: the exponent of span's float32 value (a log2
    of it can round below an integer on some devices)."""
    exponent = (span.to(torch.float32).view(torch.int32) >> 23) - 127
    return torch.where(span > 0, exponent + 1, 0)


def class_margins(margin_class: torch.Tensor) -> torch.Tensor:
    """The margin of each group's class (RAW_CLASS: 0, unused)."""
    return torch.tensor((*MARGINS, 0.0), dtype=torch.float32, device=margin_class.device)[margin_class.long()]


def group_widths(width: torch.Tensor, raw: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each weight's width in its group's encoding: its interval's, or 16 in a raw group. [..., out, in]."""
    raw_per_weight = raw.repeat_interleave(group_size, dim=-1)
    return torch.where(raw_per_weight, torch.full_like(width, RAW_BITS), width)


def layout(width: torch.Tensor, raw: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(word_start [..., out, in/g], bit offset of every weight [..., out, in], words in the stream)."""
    widths = group_widths(width, raw, group_size).to(torch.int64).unflatten(-1, (-1, group_size))  # [.., g, G]
    group_words = (widths.sum(-1) + WORD - 1) // WORD  # [..., out, in/g]
    flat = group_words.flatten()
    word_start = (torch.cumsum(flat, 0) - flat).view_as(group_words)
    within = torch.cumsum(widths, -1) - widths  # exclusive, [..., out, in/g, G]
    offsets = word_start.unsqueeze(-1) * WORD + within
    return word_start, offsets.flatten(-2), int(flat.sum())


def choose_classes(keys: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's smallest margin class whose intervals hold all its weights (else RAW_CLASS), with every
    weight's interval (lowest key, width, fold: zero-point intervals whole) in that class (0, 0, NO_FOLD in
    a raw group). Each class is tried only on the groups no narrower class held, so a tensor whose groups
    nearly all take the first class (RTN codes) costs one pass of `intervals`."""
    keys, codes = keys.reshape(-1, group_size), codes.reshape(-1, group_size)  # [N, G]: one group per row
    group_scales = scales.reshape(-1, 1)  # [N, 1]
    chosen = torch.full((keys.shape[0],), RAW_CLASS, dtype=torch.uint8, device=scales.device)
    low, width, fold = torch.zeros_like(keys), torch.zeros_like(keys), torch.full_like(keys, NO_FOLD)
    todo = None  # the groups still open, [n]; None: all of them
    for index, margin in enumerate(MARGINS):
        rows = slice(None) if todo is None else todo
        margins = torch.full((keys[rows].shape[0], 1), margin, device=scales.device)
        interval = intervals(codes[rows], group_scales[rows], dtype, group_size, margins)  # 3 x [n, G]
        fits = fold_residuals(keys[rows], *interval)[1].all(-1)  # [n]
        held = fits.nonzero().squeeze(-1) if todo is None else todo[fits]
        chosen[held] = index
        low[held], width[held], fold[held] = (part[fits] for part in interval)
        todo = (~fits).nonzero().squeeze(-1) if todo is None else todo[~fits]
        if todo.numel() == 0:
            break
    per_weight = scales.shape[:-1] + (-1,)
    return chosen.view(scales.shape), low.view(per_weight), width.view(per_weight), fold.view(per_weight)


def narrow_intervals(keys: torch.Tensor, codes: torch.Tensor, margin_class: torch.Tensor, low: torch.Tensor,
                     width: torch.Tensor, fold: torch.Tensor, group_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(zero width [..., out, in/g], low, width, fold): `choose_classes`' intervals with each group's
    zero-point intervals narrowed to its zero width (0 in raw groups)."""
    zero_width = narrow_zero_width(keys, codes, low, fold, group_size)
    zero_width[margin_class == RAW_CLASS] = 0
    zero = (codes.to(torch.int32) == ZERO_POINT) & (fold < NO_FOLD)
    zero_bits = zero_width.to(torch.int32).repeat_interleave(group_size, dim=-1)
    zero_low, zero_fold = fold_zero_point(low + fold - 1, zero_bits)  # low + fold - 1: the interval's high key
    return (zero_width, torch.where(zero, zero_low, low), torch.where(zero, zero_bits, width),
            torch.where(zero, zero_fold, fold))


def encode(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> ResidualTensor:
    """Residuals of W [..., out, in] (float16/bfloat16) against its codes [..., out, in] and scales
    [..., out, in/g]."""
    bits = bits_of(weight)
    keys = order_keys(bits)
    margin_class, *interval = choose_classes(keys, codes, scales, weight.dtype, group_size)
    zero_width, low, width, fold = narrow_intervals(keys, codes, margin_class, *interval, group_size)
    raw = margin_class == RAW_CLASS
    residual = fold_residuals(keys, low, width, fold)[0]
    value = torch.where(raw.repeat_interleave(group_size, dim=-1), bits, residual).to(torch.int64)
    word_start, offsets, total = layout(width, raw, group_size)
    words = torch.zeros(total + 1, dtype=torch.int64, device=weight.device)  # a spare word: values spill into the next
    word, shift = (offsets // WORD).flatten(), (offsets % WORD).flatten()
    shifted = value.flatten() << shift  # < 2^48: this word and maybe the next
    words.index_add_(0, word, shifted & 0xFFFFFFFF)  # residuals never overlap: adding is OR
    words.index_add_(0, word + 1, shifted >> WORD)
    return ResidualTensor(margin_class, zero_width, word_start, words[:total], weight.dtype, group_size)


def decode(encoded: ResidualTensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The exact 16-bit W [..., out, in] from its residual encoding, codes and scales."""
    low, width, fold = intervals(codes, scales, encoded.dtype, encoded.group_size,
                                 class_margins(encoded.margin_class), encoded.zero_width)
    _, offsets, _ = layout(width, encoded.raw, encoded.group_size)
    widths = group_widths(width, encoded.raw, encoded.group_size).to(torch.int64)
    words = torch.cat([encoded.words, encoded.words.new_zeros(2)])
    word, shift = offsets // WORD, offsets % WORD
    pair = words[word] | (words[word + 1] << WORD)  # 64 bits starting at the weight's word
    value = ((pair >> shift) & ((1 << widths) - 1)).to(torch.int32)
    raw = encoded.raw.repeat_interleave(encoded.group_size, dim=-1)
    bits = torch.where(raw, value, keys_to_bits(unfold_keys(value, low, fold)))
    return from_bits(bits, encoded.dtype)


def stream_as_int32(words: torch.Tensor) -> torch.Tensor:
    """The uint32 stream (held in int64) as int32 bit patterns, the layout the GPU kernel reads."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mean_bits(encoded: ResidualTensor, weights: int) -> float:
    """Bits per weight that cross PCIe, side information included."""
    return encoded.nbytes() * 8 / weights
