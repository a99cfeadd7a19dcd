"""Residual decode Triton kernel against its torch reference: CPU interpreter cases, expert shapes on CUDA."""
from tests.triton_mode import interpreted, run_interpreter_cases  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specter.kernels.residual_decode import decode_rows, decode_rows_reference  # noqa: E402
from specter.quant.gptq import gptq_quantize  # noqa: E402
from specter.quant.int4 import GROUP_SIZE, pack_codes, quantize_to_codes, symmetric_scales, unpack_codes  # noqa: E402
from specter.quant.residual import bits_of, encode  # noqa: E402


def test_interpreter_cases_in_subprocess():
    """In a compiled-mode process (CUDA machine), the CPU interpreter cases run in a fresh interpreter."""
    run_interpreter_cases(__file__)


def make_case(out: int, inputs: int, dtype: torch.dtype, draft: str, seed: int = 0):
    """(encoded, qweight [in/8, out], scales [out, in/g] as stored, weight [out, in]) of seeded weights."""
    gen = torch.Generator().manual_seed(seed)
    weight = (0.02 * torch.randn(out, inputs, generator=gen)).to(dtype)
    weight[0, :GROUP_SIZE] = 0.0  # a zero group
    weight[1, 3] = float("nan")  # a raw group
    weight[2, 5] = torch.finfo(dtype).smallest_normal / 4  # a subnormal
    if draft == "gptq":
        x = torch.randn(4 * inputs, inputs, generator=gen)
        packed = gptq_quantize(torch.nan_to_num(weight), x.T @ x)
        qweight, scales = packed.qweight, packed.scales.transpose(0, 1)
    else:
        fp32_scales = symmetric_scales(torch.nan_to_num(weight))
        qweight = pack_codes(quantize_to_codes(torch.nan_to_num(weight), fp32_scales))
        scales = fp32_scales.to(dtype)
    encoded = encode(weight, unpack_codes(qweight), scales, GROUP_SIZE)
    return encoded, qweight, scales, weight


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("draft", ["rtn", "gptq"])
def test_kernel_equals_the_reference_and_the_weights(dtype, draft):
    encoded, qweight, scales, weight = make_case(8, 2 * GROUP_SIZE, dtype, draft)
    rebuilt = decode_rows(encoded, qweight, scales)
    assert torch.equal(bits_of(rebuilt), bits_of(decode_rows_reference(encoded, qweight, scales)))
    assert torch.equal(bits_of(rebuilt), bits_of(weight))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("draft", ["rtn", "gptq"])
def test_kernel_rebuilds_a_dsv2_projection_on_cuda(dtype, draft):
    encoded, qweight, scales, weight = make_case(1408, 2048, dtype, draft)
    rebuilt = decode_rows(encoded, qweight.cuda(), scales.cuda())
    assert torch.equal(bits_of(rebuilt.cpu()), bits_of(weight))
