"""Fused INT4 MoE Triton kernel against the torch reference: CPU interpreter cases, real shapes on CUDA."""
from tests.triton_mode import INTERPRETED, ROOT, interpreted, run_interpreter_cases  # noqa: F401 (before triton)


import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specter.kernels import int4_moe as K  # noqa: E402
from specter.kernels import moe_align as A  # noqa: E402
from specter.kernels.reference import int4_moe_reference  # noqa: E402
from specter.quant.int4 import quantize_rtn  # noqa: E402

SILU = torch.nn.functional.silu


def test_interpreter_cases_in_subprocess(request):
    """In a compiled-mode process (CUDA machine), the CPU interpreter cases run in a fresh interpreter."""
    run_interpreter_cases(__file__, request)


def make_routing(tokens: int, experts: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """top_k_index [T, k] int64, distinct experts per token; `kind` shapes the per-expert load."""
    if kind == "uniform":
        probs = torch.ones(experts)
    elif kind == "hot":  # geometric popularity: a few busy experts, several idle ones
        probs = 0.35 ** torch.arange(experts, dtype=torch.float)
    elif kind == "skewed":  # every token uses experts 0..k-1 (slots shuffled); the others get nothing
        probs = torch.zeros(experts)
        probs[:k] = 1.0
    else:
        raise ValueError(kind)
    return torch.multinomial(probs.expand(tokens, experts), k, replacement=False, generator=gen)  # [T, k]


def make_case(tokens, experts, k, hidden, inter, kind, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = quantize_rtn(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05)  # [E, H/8, 2I]
    down = quantize_rtn(torch.randn(experts, hidden, inter, generator=gen) * 0.05)  # [E, I/8, H]
    x = torch.randn(tokens, hidden, generator=gen)  # [T, H]
    idx = make_routing(tokens, experts, k, kind, gen)  # [T, k]
    w = torch.randn(tokens, k, generator=gen).softmax(-1)  # [T, k]
    return (x.to(device, dtype), idx.to(device), w.to(device, dtype),
            gate_up.to(device, dtype), down.to(device, dtype))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


# (T, E, k, H, I, routing): every T in {1, 3, 16, 40}, E in {4, 8}, k in {1, 2, 3}, H and I of 1 or 2 groups
CPU_CASES = [
    (1, 4, 1, 128, 128, "uniform"),
    (1, 8, 3, 256, 128, "uniform"),
    (3, 4, 2, 128, 256, "uniform"),
    (3, 8, 2, 256, 256, "skewed"),
    (16, 8, 2, 128, 128, "uniform"),
    (16, 4, 3, 256, 128, "hot"),
    (16, 8, 1, 128, 256, "skewed"),  # all 16 rows on expert 0: exactly one full M-block
    (40, 8, 3, 128, 128, "hot"),
    (40, 4, 1, 128, 128, "skewed"),  # 40 rows on one expert: three M-blocks, the last partly padding
    (40, 8, 2, 256, 256, "uniform"),
]


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-{}".format(*c))
def test_fused_matches_reference_fp32(case):
    x, idx, w, gate_up, down = make_case(*case)
    out = K.fused_int4_moe(x, idx, w, gate_up, down, SILU)
    ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@interpreted
@pytest.mark.parametrize("case", [(3, 8, 2, 256, 128, "hot"), (16, 4, 3, 128, 256, "uniform")])
def test_fused_matches_reference_fp16_interpreter(case):
    """fp16 only: the CPU interpreter (triton 3.9) mis-converts bfloat16; the GPU tests cover it."""
    x, idx, w, gate_up, down = make_case(*case, dtype=torch.float16)
    out = K.fused_int4_moe(x, idx, w, gate_up, down, SILU)
    ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 5e-3


@interpreted
@pytest.mark.parametrize("case", [(16, 8, 2, 128, 128, "hot"), (40, 4, 1, 128, 128, "skewed")])
def test_unfused_equals_fused(case):
    x, idx, w, gate_up, down = make_case(*case)
    fused = K.fused_int4_moe(x, idx, w, gate_up, down)
    torch.testing.assert_close(K.unfused_int4_moe(x, idx, w, gate_up, down), fused, rtol=0, atol=1e-6)


@interpreted
def test_non_default_tiles_and_workspace_reuse():
    x, idx, w, gate_up, down = make_case(16, 8, 2, 256, 128, "hot")
    ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
    ws, cfg = K.MoEWorkspace(), K.KernelConfig(block_m=32, block_n=32)
    first = K.fused_int4_moe(x, idx, w, gate_up, down, workspace=ws, config=cfg)
    ptrs = {key: buf.data_ptr() for key, buf in ws._buffers.items()}
    second = K.fused_int4_moe(x[:5], idx[:5], w[:5], gate_up, down, workspace=ws, config=cfg)
    assert {key: buf.data_ptr() for key, buf in ws._buffers.items()} == ptrs  # smaller call: no reallocation
    torch.testing.assert_close(first, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second, ref[:5], rtol=1e-4, atol=1e-5)
    assert ws.nbytes() > 0


ALIGN_CASES = [(1, 64, 6, 16), (7, 8, 2, 16), (40, 8, 3, 16), (33, 4, 1, 8), (17, 65, 6, 16), (20, 9, 2, 32)]
ALIGNERS = {"torch": A.moe_align_torch, "one_launch": A.moe_align_triton}


@pytest.mark.parametrize("impl", list(ALIGNERS))
@pytest.mark.parametrize("tokens,experts,k,block_m", ALIGN_CASES)
def test_alignment_layout(tokens, experts, k, block_m, impl):
    if impl == "one_launch" and not INTERPRETED:
        pytest.skip("CPU tensors through Triton need the interpreter (the subprocess test runs this case)")
    gen = torch.Generator().manual_seed(tokens)
    idx = make_routing(tokens, experts, k, "hot", gen)  # [T, k]
    a = ALIGNERS[impl](idx, experts, block_m)
    num_pairs, used = idx.numel(), int(a.num_padded)
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    assert torch.equal(a.padded_counts, (counts + block_m - 1) // block_m * block_m)
    assert used == int(a.padded_counts.sum()) <= a.sorted_pair_ids.numel()
    real = a.sorted_pair_ids[a.sorted_pair_ids < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs))  # every pair exactly once
    assert torch.all(a.sorted_pair_ids[used:] == num_pairs)  # beyond the used rows: only padding
    blocks = a.sorted_pair_ids[:used].view(-1, block_m)  # [used / BM, BM]
    for b, row in enumerate(blocks):
        pairs = row[row < num_pairs]
        assert len(pairs) > 0  # padding never fills a whole block
        assert torch.all(idx.reshape(-1)[pairs] == a.expert_ids[b])  # one expert per block
        assert torch.all(pairs[1:] > pairs[:-1])  # token order kept inside an expert


@interpreted
@pytest.mark.parametrize("tokens,experts,k,block_m", ALIGN_CASES)
def test_one_launch_alignment_is_the_torch_alignment(tokens, experts, k, block_m):
    idx = make_routing(tokens, experts, k, "uniform", torch.Generator().manual_seed(experts))
    ws = A.MoEWorkspace()
    one, ref = A.moe_align_triton(idx, experts, block_m, ws), A.moe_align_torch(idx, experts, block_m)
    for field in ("sorted_pair_ids", "expert_ids", "num_padded", "padded_counts"):
        assert torch.equal(getattr(one, field), getattr(ref, field)), field


def test_alignment_dispatch_by_size():
    small = torch.zeros(4, 2, dtype=torch.long)
    large = torch.zeros(200, 8, dtype=torch.long)  # 1600 pairs x 64 experts: past one program
    assert A._pow2(small.numel()) * A._pow2(8) <= A.MAX_ONE_LAUNCH < A._pow2(large.numel()) * A._pow2(64)
    assert int(A.moe_align_block_size(large, 64, 16).num_padded) == 1600  # torch path, same contract


def test_zero_tokens_and_argument_checks():
    x, idx, w, gate_up, down = make_case(3, 4, 2, 128, 128, "uniform")
    assert torch.equal(K.fused_int4_moe(x[:0], idx[:0], w[:0], gate_up, down), x[:0])
    with pytest.raises(ValueError, match="SiLU"):
        K.fused_int4_moe(x, idx, w, gate_up, down, torch.nn.functional.gelu)
    with pytest.raises(ValueError, match="shape mismatch"):
        K.fused_int4_moe(x, idx, w, down, gate_up)
    from transformers.activations import ACT2FN
    assert all(K.is_silu(a) for a in (None, SILU, torch.nn.SiLU(), ACT2FN["silu"]))
    assert K.TRITON_AVAILABLE


# Real draft shapes (hidden, intermediate, experts, top_k); fp16 on CUDA with the compiled kernels.
GPU_SHAPES = {"dsv2-lite": (2048, 1408, 64, 6), "qwen1.5-moe": (2048, 1408, 60, 4), "phi3.5-moe": (4096, 6400, 16, 2)}


@pytest.mark.gpu
class TestCuda:
    @pytest.fixture(scope="class")
    def kernels(self):
        if INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1 in this process: the real shapes need the compiled kernels")
        return K

    @pytest.fixture(scope="class", params=list(GPU_SHAPES))
    def layer(self, request):
        hidden, inter, experts, k = GPU_SHAPES[request.param]
        torch.manual_seed(0)
        gate_up = quantize_rtn(torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.float16) * 0.02)
        down = quantize_rtn(torch.randn(experts, hidden, inter, device="cuda", dtype=torch.float16) * 0.02)
        return gate_up, down, experts, k

    @pytest.mark.parametrize("tokens", [1, 16, 128])
    def test_fused_matches_reference(self, kernels, layer, tokens):
        gate_up, down, experts, k = layer
        x = torch.randn(tokens, gate_up.in_features, device="cuda", dtype=torch.float16)
        idx = torch.rand(tokens, experts, device="cuda").topk(k).indices  # [T, k]
        w = torch.rand(tokens, k, device="cuda").softmax(-1).half()
        ref = int4_moe_reference(x, idx, w, gate_up, down, SILU)
        out = kernels.fused_int4_moe(x, idx, w, gate_up, down, SILU, workspace=kernels.MoEWorkspace())
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
        assert rel_err(kernels.unfused_int4_moe(x, idx, w, gate_up, down), out) < 1e-3

    @pytest.mark.parametrize("tokens", [1, 16])
    def test_fused_matches_reference_in_bfloat16(self, kernels, layer, tokens):
        """bfloat16 (the default dtype on CUDA): scales and activations in bf16, fp32 accumulation."""
        fp16_gate_up, fp16_down, experts, k = layer
        hidden, inter = fp16_gate_up.in_features, fp16_down.in_features
        torch.manual_seed(1)
        gate_up = quantize_rtn(torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02)
        down = quantize_rtn(torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        idx = torch.rand(tokens, experts, device="cuda").topk(k).indices  # [T, k]
        w = torch.rand(tokens, k, device="cuda").softmax(-1).bfloat16()
        out = kernels.fused_int4_moe(x, idx, w, gate_up, down, SILU, workspace=kernels.MoEWorkspace())
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_err(out, int4_moe_reference(x, idx, w, gate_up, down, SILU)) < 3e-2

    def test_every_window_length_runs_the_kernels_compiled_for_the_first(self, kernels, layer):
        """The pair count is not a specialisation: windows of 1..33 tokens compile nothing after the first,
        so a decode never meets a Triton compile mid-way (about 0.4 s each)."""
        gate_up, down, experts, k = layer
        workspace = kernels.MoEWorkspace()
        counts = []
        for tokens in range(1, 34):
            x = torch.randn(tokens, gate_up.in_features, device="cuda", dtype=torch.float16)
            idx = torch.rand(tokens, experts, device="cuda").topk(k).indices  # [T, k]
            w = torch.rand(tokens, k, device="cuda").softmax(-1).half()
            out = kernels.fused_int4_moe(x, idx, w, gate_up, down, SILU, workspace=workspace)
            assert rel_err(out, int4_moe_reference(x, idx, w, gate_up, down, SILU)) < 1e-2
            counts.append(workspace.compiled_kernels())
        assert counts == [3] * len(counts)  # the alignment, gate_up and down

    @pytest.mark.parametrize("tokens", [1, 17])  # a draft step; a K=16 verify window
    def test_one_launch_alignment_on_cuda(self, kernels, layer, tokens):
        _, _, experts, k = layer
        idx = torch.rand(tokens, experts, device="cuda").topk(k).indices  # [T, k]
        for num_experts in (experts, experts + 1):  # the slot kernel aligns over E + 1 (a sentinel expert)
            assert A._pow2(idx.numel()) * A._pow2(num_experts) <= A.MAX_ONE_LAUNCH  # the dispatcher's choice
            one, ref = A.moe_align_triton(idx, num_experts, 16), A.moe_align_torch(idx, num_experts, 16)
            for field in ("sorted_pair_ids", "expert_ids", "num_padded", "padded_counts"):
                assert torch.equal(getattr(one, field), getattr(ref, field)), field

    def test_fused_call_does_not_synchronize(self, kernels, layer):
        gate_up, down, experts, k = layer
        x = torch.randn(16, gate_up.in_features, device="cuda", dtype=torch.float16)
        idx = torch.rand(16, experts, device="cuda").topk(k).indices
        w = torch.rand(16, k, device="cuda").softmax(-1).half()
        ws = kernels.MoEWorkspace()
        kernels.fused_int4_moe(x, idx, w, gate_up, down, workspace=ws)  # compile outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            kernels.fused_int4_moe(x, idx, w, gate_up, down, workspace=ws)
        finally:
            torch.cuda.set_sync_debug_mode("default")
