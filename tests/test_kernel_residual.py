"""Residual decode Triton kernel against its torch reference: CPU interpreter cases, expert shapes on CUDA."""
from tests.triton_mode import interpreted, run_interpreter_cases  # noqa: F401 (before triton)

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specter.kernels.residual_decode import decode_expert, decode_expert_reference  # noqa: E402
from specter.quant.gptq import gptq_quantize  # noqa: E402
from specter.quant.int4 import GROUP_SIZE, pack_codes, quantize_rtn, unpack_codes  # noqa: E402
from specter.quant.residual import RAW_CLASS, bits_of  # noqa: E402
from specter.quant.residual_expert import encode_expert, expert_layout, split_blob  # noqa: E402


def test_interpreter_cases_in_subprocess(request):
    """In a compiled-mode process, the CPU interpreter cases run in a fresh interpreter."""
    run_interpreter_cases(__file__, request)


def linear(out: int, inputs: int, dtype: torch.dtype, group_size: int, draft: str, gen: torch.Generator):
    """(W [out, in], its draft) of seeded weights with a zero group, a NaN (raw group) and a subnormal."""
    weight = (0.02 * torch.randn(out, inputs, generator=gen)).to(dtype)
    weight[0, :group_size] = 0.0
    weight[1, 3] = float("nan")
    weight[2, 5] = torch.finfo(dtype).smallest_normal / 4
    weight[3, 7] = -0.0
    finite = torch.nan_to_num(weight)
    if draft == "gptq":
        x = torch.randn(4 * inputs, inputs, generator=gen)
        packed = gptq_quantize(finite, x.T @ x, group_size=group_size)
        return weight, type(packed)(packed.qweight, packed.scales.to(dtype), group_size)
    packed = quantize_rtn(finite, group_size)
    if draft == "spread":  # one code per group moved by 0-3 steps (by row): groups of every margin class
        codes = unpack_codes(packed.qweight)  # [out, in]
        shift = (torch.arange(out) % 4).view(out, 1).expand(out, inputs // group_size)  # [out, in/g]
        column = torch.arange(inputs // group_size) * group_size + torch.arange(out).view(out, 1) % group_size
        moved = codes.gather(1, column).int() + torch.where(column % 2 == 0, shift, -shift)
        codes.scatter_(1, column, moved.clamp(0, 15).to(torch.uint8))
        packed = type(packed)(pack_codes(codes), packed.scales, group_size)
    return weight, packed


def make_expert(hidden: int, intermediate: int, group_size: int, dtype: torch.dtype, draft: str, seed: int = 0):
    """(layout, blob, drafts, flat weights) of one seeded expert."""
    gen = torch.Generator().manual_seed(seed)
    layout = expert_layout(hidden, intermediate, group_size)
    weights, drafts = zip(*(linear(o, i, dtype, group_size, draft, gen) for o, i in layout.shapes))
    blob = encode_expert(list(weights), list(drafts))
    return layout, blob, list(drafts), torch.cat([w.flatten() for w in weights])


def test_blob_splits_back_into_its_linears():
    layout, blob, drafts, _ = make_expert(64, 32, 32, torch.bfloat16, "rtn")
    gate_up, down = split_blob(blob, layout, torch.bfloat16)
    assert gate_up.margin_class.shape == (64, 2) and down.margin_class.shape == (64, 1)
    assert int(gate_up.word_start[0, 0]) == 0 and int(down.word_start[0, 0]) == 0
    assert layout.stream_word + gate_up.words.numel() + down.words.numel() == blob.numel()


def test_a_group_longer_than_its_count_byte_is_refused():
    """A group's word count takes a byte: groups of 1024 weights (up to 512 words) do not fit the blob."""
    with pytest.raises(ValueError, match="count byte"):
        make_expert(1024, 1024, 1024, torch.bfloat16, "rtn")


def test_a_batched_encode_gives_each_experts_own_blob():
    from specter.quant.int4 import Int4Linear
    from specter.quant.residual_expert import encode_experts

    experts = [make_expert(40, 24, 8, torch.bfloat16, "rtn", seed=seed) for seed in range(3)]
    layout = experts[0][0]
    weights = [torch.stack([w[layout.output_base(p):layout.output_base(p) + o * i].view(o, i) for *_, w in experts])
               for p, (o, i) in enumerate(layout.shapes)]
    drafts = [Int4Linear(torch.stack([e[2][p].qweight for e in experts]),
                         torch.stack([e[2][p].scales for e in experts]), 8) for p in range(2)]
    assert all(torch.equal(a, e[1]) for a, e in zip(encode_experts(weights, drafts), experts))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("draft", ["rtn", "gptq"])
@pytest.mark.parametrize("shape", [(256, 128, GROUP_SIZE), (40, 24, 8)],
                         ids=["256-rows", "40-rows"])  # 40 rows: a partial row tile, 3 groups a row
def test_kernel_equals_the_reference_and_the_weights(dtype, draft, shape):
    layout, blob, drafts, weights = make_expert(*shape, dtype, draft)
    rebuilt = decode_expert(blob, layout, drafts, torch.empty_like(weights))
    assert torch.equal(bits_of(rebuilt), bits_of(decode_expert_reference(blob, layout, drafts, dtype)))
    assert torch.equal(bits_of(rebuilt), bits_of(weights))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_decodes_groups_of_every_margin_class(dtype):
    layout, blob, drafts, weights = make_expert(256, 128, GROUP_SIZE, dtype, "spread")
    classes = torch.cat([part.margin_class.flatten() for part in split_blob(blob, layout, dtype)])
    assert set(classes.unique().tolist()) == set(range(RAW_CLASS + 1))
    rebuilt = decode_expert(blob, layout, drafts, torch.empty_like(weights))
    assert torch.equal(bits_of(rebuilt), bits_of(weights))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [32, 64])
def test_every_tile_decodes_the_weights(dtype, block_rows):
    """The plans a tile sweep launches (rows per program) rebuild every margin class bit for bit."""
    from specter.kernels.residual_decode import DecodePlan, expert_operands, launch_decode

    layout, blob, drafts, weights = make_expert(40, 24, 8, dtype, "spread")
    plan = DecodePlan.of(layout, dtype, block_rows=block_rows, num_warps=2)
    rebuilt = launch_decode(plan, expert_operands(drafts, dtype), blob, torch.empty_like(weights))
    assert torch.equal(bits_of(rebuilt), bits_of(weights))


@pytest.mark.parametrize("block_rows", [8, 24])
def test_a_tile_the_compiler_cannot_lower_is_refused_before_launch(block_rows):
    from specter.kernels.residual_decode import DecodePlan

    layout = make_expert(40, 24, 8, torch.bfloat16, "rtn")[0]
    with pytest.raises(ValueError, match="power of two >= 16"):
        DecodePlan.of(layout, torch.bfloat16, block_rows=block_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("draft", ["rtn", "gptq", "spread"])
def test_kernel_rebuilds_a_dsv2_expert_on_cuda(dtype, draft):
    layout, blob, drafts, weights = dsv2_expert(dtype, draft)
    rebuilt = decode_expert(blob, layout, drafts, torch.empty_like(weights))
    assert torch.equal(bits_of(rebuilt.cpu()), bits_of(weights.cpu()))


@functools.cache
def dsv2_expert(dtype: torch.dtype, draft: str) -> tuple:
    """`make_expert` at dsv2's expert size on the GPU, encoded once per dtype and draft."""
    layout, blob, drafts, weights = make_expert(2048, 1408, GROUP_SIZE, dtype, draft)
    return layout, blob.cuda(), [d.to("cuda") for d in drafts], weights.cuda()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16])  # bfloat16: the next test (the kernel's math: both, above)
def test_kernel_rebuilds_a_tiny_models_offloaded_experts(dtype):
    """The launch the copy path makes (prepared plan and operands) on a residual store's blobs."""
    import specter
    from specter.kernels.residual_decode import DecodeLauncher, DecodePlan, expert_operands
    from specter.offload.runtime import offload_experts

    runtime = offload_experts(specter.load_model("tiny-qwen", device="cpu", dtype=dtype), 2, residual=True)
    residuals, launcher = runtime.residuals, DecodeLauncher(DecodePlan.of(runtime.residuals.layout, dtype))
    for layer, expert in [(0, 0), (0, 5), (1, 7)]:
        operands = expert_operands(residuals.expert_drafts(layer, expert), dtype)
        out = torch.empty(runtime.store.numel, dtype=dtype)
        rebuilt = launcher(operands, residuals.blob(layer, expert), out)
        assert torch.equal(bits_of(rebuilt), bits_of(runtime.store.expert(layer, expert)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_launcher_reuses_its_compiled_kernel_bit_exactly_on_cuda(dtype):
    """After its first launch the DecodeLauncher calls the compiled kernel directly: blobs of other lengths,
    at other offsets (unaligned included), and other output rows still decode bit for bit."""
    from specter.kernels.residual_decode import DecodeLauncher, DecodePlan, expert_operands

    experts = [make_expert(256, 128, GROUP_SIZE, dtype, "rtn", seed=seed) for seed in range(4)]
    launcher = DecodeLauncher(DecodePlan.of(experts[0][0], dtype))
    staging = torch.zeros(max(e[1].numel() for e in experts) + 8, dtype=torch.int32, device="cuda")
    out = torch.empty(3, experts[0][3].numel() + 8, dtype=dtype, device="cuda")
    for i, (_, blob, drafts, weights) in enumerate(experts + experts):
        start = i % 3  # offsets of 0, 4 and 8 bytes
        staged = staging[start:start + blob.numel()]
        staged.copy_(blob)
        row = out[i % 3, start:start + weights.numel()]
        launcher(expert_operands([d.to("cuda") for d in drafts], dtype), staged, row)
        assert torch.equal(bits_of(row.cpu()), bits_of(weights)), i
    assert len(launcher.launch.compiled) >= 2  # aligned and unaligned pointers compile apart


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # float16: the test above
def test_one_launch_rebuilds_several_experts_of_a_layer(dtype):
    """`decode_experts`: blobs at their staging offsets, each expert into its own pool row (not in order)."""
    import specter
    from specter.kernels.residual_decode import decode_experts, group_table
    from specter.offload.runtime import offload_experts

    runtime = offload_experts(specter.load_model("tiny-qwen", device="cpu", dtype=dtype), 2, residual=True)
    residuals, store, layer, experts = runtime.residuals, runtime.store, 1, [6, 0, 3]
    capacity = residuals.max_blob_words
    staging = torch.zeros(len(experts), capacity, dtype=torch.int32)
    for row, expert in enumerate(experts):
        blob = residuals.blob(layer, expert)
        staging[row, :blob.numel()] = blob
    pool = torch.zeros(len(experts) + 1, store.numel, dtype=dtype)
    out_rows = [2, 0, 3]
    items = group_table([(row * capacity, residuals.blob(layer, e).numel(), pool[out_rows[row]], e)
                         for row, e in enumerate(experts)], pool)
    assert items[0].tolist() == [0, residuals.blob(layer, 6).numel(), 6, 2 * store.numel]
    decode_experts(staging, pool, items, residuals.layout, list(residuals.drafts[layer]))
    for expert, row in zip(experts, out_rows):
        assert torch.equal(bits_of(pool[row]), bits_of(store.expert(layer, expert)))
    assert not pool[1].any()  # no item writes the unused row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_launch_rebuilds_several_dsv2_experts_on_cuda(dtype):
    """`decode_experts` at the real expert shape: 3 seeded experts stacked as a layer, into shuffled pool rows."""
    from specter.kernels.residual_decode import decode_experts, group_table
    from specter.quant.int4 import Int4Linear

    experts = [make_expert(2048, 1408, GROUP_SIZE, dtype, "rtn", seed=seed) for seed in range(3)]
    layout, capacity = experts[0][0], max(e[1].numel() for e in experts)
    drafts = [Int4Linear(torch.stack([e[2][p].qweight for e in experts]).cuda(),
                         torch.stack([e[2][p].scales for e in experts]).cuda(), GROUP_SIZE) for p in range(2)]
    staging = torch.zeros(3, capacity, dtype=torch.int32, device="cuda")
    for row, (_, blob, _, _) in enumerate(experts):
        staging[row, :blob.numel()] = blob.cuda()
    pool = torch.zeros(4, experts[0][3].numel(), dtype=dtype, device="cuda")
    out_rows = [3, 0, 1]
    items = group_table([(row * capacity, e[1].numel(), pool[out_rows[row]], row) for row, e in enumerate(experts)],
                        pool)
    decode_experts(staging, pool, items.cuda(), layout, drafts)
    for (_, _, _, weights), row in zip(experts, out_rows):
        assert torch.equal(bits_of(pool[row].cpu()), bits_of(weights))
    assert not pool[2].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bound_group_launches_decode_other_items_and_buffers_bit_exactly_on_cuda():
    """DecodeLauncher.group after its first launch of a layer's group size: only the items change (straight to
    the compiled launcher), and a launch into another pool forgets the bound launches; every row bit-exact."""
    from specter.kernels.residual_decode import DecodeLauncher, DecodePlan, expert_operands, group_table
    from specter.quant.int4 import Int4Linear

    dtype = torch.float16
    experts = [make_expert(256, 128, GROUP_SIZE, dtype, "rtn", seed=seed) for seed in range(4)]
    layout, capacity = experts[0][0], max(e[1].numel() for e in experts)
    drafts = [Int4Linear(torch.stack([e[2][p].qweight for e in experts]).cuda(),
                         torch.stack([e[2][p].scales for e in experts]).cuda(), GROUP_SIZE) for p in range(2)]
    operands, launcher = expert_operands(drafts, dtype), DecodeLauncher(DecodePlan.of(layout, dtype))
    staging = torch.zeros(4, capacity, dtype=torch.int32, device="cuda")
    for row, (_, blob, _, _) in enumerate(experts):
        staging[row, :blob.numel()] = blob.cuda()
    for pool_rows, chosen in [(5, [0, 1]), (5, [3, 2]), (5, [1, 3]), (6, [2, 0])]:  # the last: another pool
        pool = torch.zeros(pool_rows, experts[0][3].numel(), dtype=dtype, device="cuda")
        out_rows = [pool_rows - 1, 1]
        items = group_table([(e * capacity, experts[e][1].numel(), pool[r], e) for e, r in zip(chosen, out_rows)], pool)
        launcher.group(operands, staging, pool, items.cuda())
        for expert, row in zip(chosen, out_rows):
            assert torch.equal(bits_of(pool[row].cpu()), bits_of(experts[expert][3])), (chosen, expert)
        assert len(launcher.bound_groups) == 1

