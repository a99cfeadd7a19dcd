"""INT4 decode (one GEMV program row per routed pair) Triton kernel against the torch reference."""
from tests.triton_mode import INTERPRETED, interpreted, run_interpreter_cases  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specter.kernels import int4_decode as D  # noqa: E402
from specter.kernels.int4_moe import MoEWorkspace  # noqa: E402
from specter.kernels.reference import int4_moe_reference  # noqa: E402
from specter.quant.int4 import quantize_rtn  # noqa: E402
from tests.test_kernel_int4 import GPU_SHAPES, make_case, rel_err  # noqa: E402

SILU = torch.nn.functional.silu


def test_interpreter_cases_in_subprocess(request):
    """In a compiled-mode process (CUDA machine), the CPU interpreter cases run in a fresh interpreter."""
    run_interpreter_cases(__file__, request)


# (T, E, k, H, I, routing): one token (a draft step) and a few (a small batch), 1 or 2 groups per dim,
# pairs that share an expert
CPU_CASES = [
    (1, 4, 1, 128, 128, "uniform"),
    (1, 8, 3, 256, 128, "uniform"),
    (4, 4, 3, 128, 256, "hot"),
]


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-{}".format(*c))
def test_decode_matches_reference_fp32(case):
    x, idx, w, gate_up, down = make_case(*case)
    out = D.int4_moe_decode(x, idx, w, gate_up, down, SILU)
    ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@interpreted
def test_decode_strips_wider_than_the_output_are_masked():
    x, idx, w, gate_up, down = make_case(2, 4, 2, 128, 128, "uniform")
    wide = D.DecodeConfig(gate_up_block_n=256, down_block_n=256)  # both outputs are 128 wide
    out = D.int4_moe_decode(x, idx, w, gate_up, down, config=wide)
    torch.testing.assert_close(out, int4_moe_reference(x, idx, w, gate_up, down, SILU), rtol=1e-4, atol=1e-5)


@interpreted
def test_decode_fp16_narrow_strips_and_workspace_reuse():
    x, idx, w, gate_up, down = make_case(3, 8, 2, 128, 128, "hot", dtype=torch.float16)
    ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
    ws, cfg = MoEWorkspace(), D.DecodeConfig(gate_up_block_n=16, down_block_n=16, num_stages=2, num_warps=2)
    first = D.int4_moe_decode(x, idx, w, gate_up, down, workspace=ws, config=cfg)
    ptrs = {key: buf.data_ptr() for key, buf in ws._buffers.items()}
    second = D.int4_moe_decode(x[:1], idx[:1], w[:1], gate_up, down, workspace=ws, config=cfg)
    assert {key: buf.data_ptr() for key, buf in ws._buffers.items()} == ptrs  # smaller call: no reallocation
    assert first.dtype == torch.float16
    assert rel_err(first, ref) < 5e-3 and rel_err(second, ref[:1]) < 5e-3


def test_zero_pairs_and_argument_checks():
    x, idx, w, gate_up, down = make_case(3, 4, 2, 128, 128, "uniform")
    assert torch.equal(D.int4_moe_decode(x[:0], idx[:0], w[:0], gate_up, down), x[:0])
    with pytest.raises(ValueError, match="SiLU"):
        D.int4_moe_decode(x, idx, w, gate_up, down, torch.nn.functional.gelu)
    with pytest.raises(ValueError, match="shape mismatch"):
        D.int4_moe_decode(x, idx, w, down, gate_up)
    with pytest.raises(ValueError, match="block_k"):
        D.int4_moe_decode(x, idx, w, gate_up, down, config=D.DecodeConfig(block_k=64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("tokens", [1, 4])
def test_decode_matches_reference_on_cuda(shape, tokens, dtype):
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs CUDA and the compiled kernels")
    hidden, inter, experts, k = GPU_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = quantize_rtn(torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) * 0.02)
    down = quantize_rtn(torch.randn(experts, hidden, inter, device="cuda", dtype=dtype, generator=gen) * 0.02)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(k).indices  # [T, k]
    w = torch.rand(tokens, k, device="cuda", generator=gen).softmax(-1).to(dtype)
    ref = int4_moe_reference(x.float(), idx, w.float(), gate_up.to(dtype=torch.float32),
                             down.to(dtype=torch.float32), SILU)
    out = D.int4_moe_decode(x, idx, w, gate_up, down, SILU, workspace=MoEWorkspace())
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2
