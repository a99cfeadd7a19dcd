"""INT4 GPTQ-layout packing, round-to-nearest quantization and dequantization."""
import pytest
import torch

from specter.quant.int4 import (
    GROUP_SIZE,
    dequantize,
    pack_codes,
    quantize_rtn,
    quantize_to_codes,
    select_expert,
    symmetric_scales,
    unpack_codes,
)


@pytest.mark.parametrize("shape", [(8, 128), (3, 16, 256), (2, 5, 384)])
def test_pack_unpack_round_trip(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.dtype == torch.int32
    assert packed.shape == (*shape[:-2], shape[-1] // 8, shape[-2])  # [..., in/8, out]
    assert packed.is_contiguous()  # kernels index it as row-major memory
    assert torch.equal(unpack_codes(packed), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_round_each_weight_over_its_groups_scale(dtype):
    weight = (0.02 * torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    scales = symmetric_scales(weight, 16)  # [2, 6, 4]
    per_weight = scales.repeat_interleave(16, dim=-1)  # [2, 6, 64]
    expected = torch.clamp(torch.round(weight.float() / per_weight) + 8, 0, 15).to(torch.uint8)
    assert torch.equal(quantize_to_codes(weight, scales, 16), expected)


def test_gptq_nibble_order():
    """Input column i sits in nibble i % 8 of row i // 8 (low nibble first), as GPTQ stores it."""
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 1] = 0xF  # column 1 -> bits 4..7 of row 0
    codes[0, 15] = 0x9  # column 15 -> bits 28..31 of row 1 (sign bit: negative int32)
    packed = pack_codes(codes)
    assert packed[0, 0].item() == 0xF0
    assert packed[1, 0].item() == (0x9 << 28) - 2**32


def test_zero_weights_pack_to_zero_point():
    packed = quantize_rtn(torch.zeros(4, 128))
    assert torch.all(packed.qweight == 0x88888888 - 2**32)  # every code is the zero point 8


@pytest.mark.parametrize("seed", [0, 1])
def test_dequantized_error_within_half_step(seed):
    torch.manual_seed(seed)
    w = torch.randn(6, 64, 256)
    packed = quantize_rtn(w)
    assert packed.qweight.shape == (6, 32, 64) and packed.scales.shape == (6, 2, 64)
    err = (dequantize(packed) - w).abs()  # [6, 64, 256]
    step = symmetric_scales(w).repeat_interleave(GROUP_SIZE, dim=-1)  # [6, 64, 256]
    assert torch.all(err <= step / 2 + 1e-6)
    assert err.max() > 0  # INT4 is lossy: a zero error would mean the weights were not quantized


def test_select_expert_matches_stacked_dequantize():
    w = torch.randn(3, 32, 128)
    packed = quantize_rtn(w)
    assert torch.equal(dequantize(select_expert(packed, 2)), dequantize(packed)[2])


def test_input_dim_must_be_group_multiple():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_rtn(torch.randn(4, 100))
