"""INT4 symmetric group quantization in the GPTQ packed layout (qweight [in/8, out], scales [in/g, out])."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 128
PACK = 8  # nibbles per int32
ZERO_POINT = 8  # symmetric 4-bit: stored value q in [0, 15] means (q - 8) * scale
MAXQ = 15


@dataclass
class Int4Linear:
    """Packed weights of a stack of linears W [..., out, in] (leading dims = experts).

    qweight: [..., in/8, out] int32, nibble i%8 of row i//8 holds input column i (GPTQ order).
    scales:  [..., in/group, out] floating point, one per group of `group_size` input columns.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int = GROUP_SIZE

    @property
    def in_features(self) -> int:
        return self.qweight.shape[-2] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[-1]

    def to(self, device=None, dtype=None) -> Int4Linear:
        return Int4Linear(self.qweight.to(device), self.scales.to(device=device, dtype=dtype), self.group_size)

    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()


def _check_shape(weight: torch.Tensor, group_size: int) -> None:
    in_features = weight.shape[-1]
    if in_features % group_size or group_size % PACK:
        raise ValueError(f"input dim {in_features} must be a multiple of the group size {group_size}")


def symmetric_scales(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """GPTQ's symmetric scale per (group, output row): 2 * max|w| / 15. Returns [..., out, in/g]."""
    _check_shape(weight, group_size)
    groups = weight.float().unflatten(-1, (-1, group_size))  # [..., out, in/g, g]
    amax = groups.abs().amax(dim=-1).clamp_min(1e-8)
    return 2 * amax / MAXQ


def quantize_to_codes(weight: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Round W [..., out, in] to 4-bit codes given scales [..., out, in/g]; returns uint8 codes in [0, 15]."""
    groups = weight.float().unflatten(-1, (-1, group_size)) / scales.unsqueeze(-1)  # [..., out, in/g, g]
    return torch.clamp(torch.round(groups) + ZERO_POINT, 0, MAXQ).to(torch.uint8).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., out, in] -> int32 qweight [..., in/8, out] (8 nibbles along the input dim)."""
    c = codes.transpose(-1, -2).unflatten(-2, (-1, PACK))  # [..., in/8, 8, out] uint8
    packed = c[..., 0, :].to(torch.int32, memory_format=torch.contiguous_format)  # [..., in/8, out] row-major
    for nibble in range(1, PACK):  # int32 shifts wrap: nibble 7 lands in the sign bit, as the layout wants
        packed |= c[..., nibble, :].to(torch.int32) << (4 * nibble)
    return packed


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 qweight [..., in/8, out] -> uint8 codes [..., out, in]."""
    shifts = (torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4).view(PACK, 1)
    nibbles = (qweight.unsqueeze(-2) >> shifts) & 0xF  # [..., in/8, 8, out]
    return nibbles.flatten(-3, -2).transpose(-1, -2).to(torch.uint8)


def quantize_rtn(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Linear:
    """Round-to-nearest INT4 quantization of W [..., out, in] into the packed layout."""
    scales = symmetric_scales(weight, group_size)  # [..., out, in/g]
    codes = quantize_to_codes(weight, scales, group_size)
    return Int4Linear(pack_codes(codes), scales.transpose(-1, -2).to(weight.dtype).contiguous(), group_size)


def dequantize(packed: Int4Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed INT4 -> dense W [..., out, in] in `dtype` (default: the scales' dtype)."""
    dtype = dtype or packed.scales.dtype
    codes = unpack_codes(packed.qweight).to(dtype) - ZERO_POINT  # [..., out, in]
    scales = packed.scales.transpose(-1, -2).to(dtype)  # [..., out, in/g]
    return codes * scales.repeat_interleave(packed.group_size, dim=-1)


def select_expert(packed: Int4Linear, expert: int) -> Int4Linear:
    """The packed weights of one expert of a stacked [E, ...] Int4Linear."""
    return Int4Linear(packed.qweight[expert], packed.scales[expert], packed.group_size)
