"""GPTQ INT4 draft quantization: the algorithm on one linear and on the routed experts of a tiny model."""

import pytest
import torch
from transformers import DynamicCache

import specter
from specter.errors import SpecterError
from specter.kernels.reference import expert_wise_moe, int4_moe_reference
from specter.quant.gptq import HessianAccumulator, experts_per_batch, gptq_quantize, quantize_experts_gptq
from specter.quant.int4 import GROUP_SIZE, dequantize, pack_codes, quantize_rtn, symmetric_scales, unpack_codes

CALIBRATION = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The tower is 324 metres tall, about the same height as an 81-storey building in Paris.",
]


def fresh(name: str = "tiny-qwen", seed: int = 0) -> specter.HybridMoEModel:
    """A new model object (not the shared cached one: these tests replace its draft weights)."""
    return specter.load_model(name, device="cpu", dtype=torch.float32, seed=seed)


def token_ids(model, texts=CALIBRATION) -> list[torch.Tensor]:
    return [torch.tensor([model.tokenizer(t)["input_ids"]]) for t in texts]


def reference_gptq(W, H, groupsize=128, blocksize=128, percdamp=0.01, maxq=15):
    """Port of the original GPTQ `fasterquant` (sym, groupsize, act_order=False, static_groups=False): dequantized Q."""
    W, H = W.clone().float(), H.clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    Q = torch.zeros_like(W)
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(cols)
    H[diag, diag] += damp
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            if (i1 + i) % groupsize == 0:  # find_params(sym=True) on the group's weights
                x = W[:, i1 + i:i1 + i + groupsize]
                xmax = torch.maximum(x.min(1).values.clamp(max=0).abs(), x.max(1).values.clamp(min=0))
                xmax[xmax == 0] = 1
                scale, zero = 2 * xmax / maxq, (maxq + 1) / 2
            q = scale * (torch.clamp(torch.round(w / scale) + zero, 0, maxq) - zero)
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return Q


def draft_buffers(model) -> dict:
    return {f"{l}.{n}": b for l, m in enumerate(model.experts) for n, b in m.named_buffers() if n.startswith("draft")}


def correlated_inputs(n: int, columns: int, rank: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, rank, generator=g) @ torch.randn(rank, columns, generator=g)
            + 0.05 * torch.randn(n, columns, generator=g))


# (a) the algorithm on one linear


def test_hessian_accumulates_incrementally():
    x = correlated_inputs(300, 64)
    acc = HessianAccumulator(64)
    for chunk in x.split(70):
        acc.add(chunk)
    assert acc.count == 300
    torch.testing.assert_close(acc.finalize(), 2 * x.T @ x / 300, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        HessianAccumulator(8).finalize()


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_beats_rtn_on_correlated_inputs(seed):
    torch.manual_seed(seed)
    w = torch.randn(96, 384)
    x = correlated_inputs(512, 384, seed=seed)
    acc = HessianAccumulator(384)
    acc.add(x)
    gptq, rtn = gptq_quantize(w, acc.finalize()), quantize_rtn(w)
    err_gptq = (x @ w.T - x @ dequantize(gptq).T).norm()
    err_rtn = (x @ w.T - x @ dequantize(rtn).T).norm()
    assert err_gptq < 0.6 * err_rtn, (err_gptq, err_rtn)


def test_gptq_matches_the_reference_algorithm():
    """Bit-identical to a port of the original GPTQ loop (group 128 = block 128), including a dead column."""
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    x = correlated_inputs(200, 256, seed=2)
    x[:, 7] = 0  # dead input column: GPTQ zeroes the weight column
    acc = HessianAccumulator(256)
    acc.add(x)
    h = acc.finalize()
    ours = dequantize(gptq_quantize(w, h))
    assert torch.equal(ours, reference_gptq(w, h))
    assert torch.all(ours[:, 7] == 0)


def test_gptq_packed_layout_and_batching():
    torch.manual_seed(3)
    w = torch.randn(3, 40, 256)
    hs = []
    for e in range(3):
        acc = HessianAccumulator(256)
        acc.add(correlated_inputs(150, 256, seed=10 + e))
        hs.append(acc.finalize())
    packed = gptq_quantize(w, torch.stack(hs))
    assert packed.qweight.shape == (3, 32, 40) and packed.qweight.dtype == torch.int32
    assert packed.scales.shape == (3, 2, 40) and packed.scales.dtype == w.dtype
    codes = unpack_codes(packed.qweight)
    assert torch.equal(pack_codes(codes), packed.qweight)
    assert codes.max() <= 15
    assert torch.all(packed.scales > 0)
    # dequantize = (code - 8) * scale of the column's group
    expected = (codes.float() - 8) * packed.scales.transpose(-1, -2).repeat_interleave(GROUP_SIZE, dim=-1)
    assert torch.equal(dequantize(packed), expected)
    # the first group's scale comes from the untouched weights: 2 max|w| / 15, as RTN
    torch.testing.assert_close(packed.scales[:, 0], symmetric_scales(w)[..., 0])
    # a batch is the same as one linear at a time
    for e in range(3):
        single = gptq_quantize(w[e], hs[e])
        assert torch.equal(single.qweight, packed.qweight[e]) and torch.equal(single.scales, packed.scales[e])
    # Hessians given as a list are consumed (released once factored), with the same result
    given = [h.clone() for h in hs]
    listed = gptq_quantize(w, given)
    assert given == [None] * 3 and torch.equal(listed.qweight, packed.qweight)
    with pytest.raises(ValueError, match="2 Hessians do not fit"):
        gptq_quantize(w, hs[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_and_a_zero_group(dtype):
    torch.manual_seed(5)
    w = (0.05 * torch.randn(16, 256)).to(dtype)
    w[:, 128:] = 0  # an all-zero group: its scale must not round to 0 (0/0 would give NaN codes)
    # H = I: no error feedback between columns (otherwise GPTQ fills the zero group with compensation)
    packed = gptq_quantize(w, torch.eye(256))
    assert packed.scales.dtype == dtype and torch.all(packed.scales > 0)
    deq = dequantize(packed, torch.float32)
    assert torch.isfinite(deq).all() and torch.all(deq[:, 128:] == 0)
    # with H = I, GPTQ is round-to-nearest with the (storage-rounded) scale: within half a step, give or take
    # the scale's rounding at the group's largest weight (7.5 steps, clamped to code 15)
    step = packed.scales[0].float()  # [out], group 0
    slack = 1 + 16 * torch.finfo(dtype).eps
    assert torch.all((deq[:, :128] - w[:, :128].float()).abs() <= step[:, None] / 2 * slack)


def test_dampening_grows_only_where_cholesky_fails():
    torch.manual_seed(4)
    w = torch.randn(2, 16, 128)
    acc = HessianAccumulator(128)
    acc.add(correlated_inputs(100, 128, seed=4))
    indefinite = torch.ones(128, 128) - 0.5 * torch.eye(128)  # eigenvalues 127.5 and -0.5: needs 1000x damp
    packed = gptq_quantize(w, torch.stack([acc.finalize(), indefinite]))
    assert torch.isfinite(packed.scales).all()
    alone = gptq_quantize(w[0], acc.finalize())
    assert torch.equal(alone.qweight, packed.qweight[0]) and torch.equal(alone.scales, packed.scales[0])
    with pytest.raises(SpecterError, match="positive definite"):
        gptq_quantize(w[0], -torch.eye(128))


# (b) the routed experts of a tiny model


@pytest.fixture(scope="module")
def calibrated():
    """A fresh tiny-qwen, its experts' target-mode inputs on the calibration prompts, and the GPTQ report."""
    model = fresh()
    ids = token_ids(model)
    captured = {l: [] for l in range(model.num_moe_layers)}
    hooks = [m.register_forward_hook(lambda mod, args, out, l=l: captured[l].append([a.clone() for a in args]))
             for l, m in enumerate(model.experts)]
    for x in ids:
        model.forward(x, DynamicCache(config=model.hf.config))
    for h in hooks:
        h.remove()
    report = quantize_experts_gptq(model, ids)
    return model, captured, report


def relative_expert_error(module, calls, gate_up, down) -> float:
    err = ref = 0.0
    with torch.no_grad():
        for hidden, idx, weights in calls:
            fp = expert_wise_moe(hidden, idx, weights, module.target_weights, module.num_experts, module.act_fn)
            q = int4_moe_reference(hidden, idx, weights, gate_up, down, module.act_fn)
            err += (q - fp).pow(2).sum().item()
            ref += fp.pow(2).sum().item()
    return (err / ref) ** 0.5


def test_gptq_experts_beat_rtn_on_the_calibration_activations(calibrated):
    model, captured, report = calibrated
    assert model.quantizer == "gptq"
    assert report["calibration_tokens"] == sum(x.shape[-1] for x in token_ids(model))
    assert len(report["layers"]) == model.num_moe_layers
    for l, module in enumerate(model.experts):
        rtn = quantize_rtn(module.gate_up_proj.detach()), quantize_rtn(module.down_proj.detach())
        e_gptq = relative_expert_error(module, captured[l], module.draft_gate_up, module.draft_down)
        e_rtn = relative_expert_error(module, captured[l], *rtn)
        assert e_gptq < 0.8 * e_rtn, (l, e_gptq, e_rtn)
        row = report["layers"][l]
        assert row["gptq_experts"] + row["rtn_fallback_experts"] == module.num_experts
        assert row["gptq_experts"] == int(torch.cat([c[1].flatten() for c in captured[l]]).unique().numel())


def test_gptq_expert_buffers_use_the_int4_layout(calibrated):
    model, _, _ = calibrated
    for module in model.experts:
        for packed, weight in ((module.draft_gate_up, module.gate_up_proj), (module.draft_down, module.down_proj)):
            e, out_features, in_features = weight.shape
            assert packed.qweight.shape == (e, in_features // 8, out_features)
            assert packed.scales.shape == (e, in_features // GROUP_SIZE, out_features)
            codes = unpack_codes(packed.qweight)
            assert torch.equal(pack_codes(codes), packed.qweight) and int(codes.max()) <= 15
            per_col = packed.scales.transpose(-1, -2).repeat_interleave(GROUP_SIZE, dim=-1)
            assert torch.equal(dequantize(packed), (codes.float() - 8) * per_col)
            assert not torch.equal(packed.qweight, quantize_rtn(weight.detach()).qweight)  # really GPTQ, not RTN


def test_unrouted_experts_fall_back_to_rtn_and_passes_agree():
    """A 3-token prompt routes at most 6 of 8 experts per layer; one layer per pass gives the same weights."""
    model = fresh()
    ids = [torch.tensor([[256, 72, 105]])]
    report = quantize_experts_gptq(model, ids, layers_per_pass=1)
    assert report["passes"] == model.num_moe_layers
    assert report["rtn_fallback_experts"] >= 2 * model.num_moe_layers
    per_pass = [(m.draft_gate_up_qweight.clone(), m.draft_down_scales.clone()) for m in model.experts]
    for row, module in zip(report["layers"], model.experts):
        rtn = quantize_rtn(module.gate_up_proj.detach())
        same = [torch.equal(module.draft_gate_up_qweight[e], rtn.qweight[e]) for e in range(module.num_experts)]
        assert sum(same) >= row["rtn_fallback_experts"] >= 2
    quantize_experts_gptq(model, ids)  # all layers in one pass
    for (qweight, scales), module in zip(per_pass, model.experts):
        assert torch.equal(qweight, module.draft_gate_up_qweight) and torch.equal(scales, module.draft_down_scales)


def test_expert_batches_follow_the_memory_budget():
    """Experts per GPTQ batch fit the budget in batches of even size (one Mixtral down projection alone in
    4 GiB), and a budget that forces one expert at a time gives the same draft as the default."""
    assert experts_per_batch(14336, 4096, 4 << 30, routed=8) == 1
    assert experts_per_batch(4096, 28672, 4 << 30, routed=8) == 4
    assert experts_per_batch(2048, 2816, 4 << 30, routed=64) == 64
    assert experts_per_batch(2048, 2816, 1, routed=64) == 1
    per_expert, temporaries = (14336 ** 2 + 2 * 4096 * 14336) * 4, 16 * 14336 ** 2
    assert experts_per_batch(14336, 4096, temporaries + 8 * per_expert, routed=8) == 8
    assert experts_per_batch(14336, 4096, temporaries + 7 * per_expert, routed=8) == 4  # two even batches
    ids = [torch.tensor([[256, 72, 105, 33, 7, 99]])]
    model = fresh()
    quantize_experts_gptq(model, ids)
    batched = [(m.draft_gate_up_qweight.clone(), m.draft_down_scales.clone()) for m in model.experts]
    quantize_experts_gptq(model, ids, hessian_budget_bytes=1)
    for (qweight, scales), module in zip(batched, model.experts):
        assert torch.equal(qweight, module.draft_gate_up_qweight) and torch.equal(scales, module.draft_down_scales)


def test_experts_in_the_host_store_quantize_the_same():
    """FP experts moved to the host store (offloaded): same GPTQ draft as with the experts on the module."""
    from specter.offload.runtime import move_experts_to_store

    on_module, on_host = fresh(), fresh()
    on_host.host_store = move_experts_to_store(on_host)
    assert getattr(on_host.experts[0], "gate_up_proj", None) is None
    ids = token_ids(on_module, CALIBRATION[:2])
    quantize_experts_gptq(on_module, ids)
    report = quantize_experts_gptq(on_host, ids, layers_per_pass=2)
    assert report["passes"] == 2 and all(m.target_executor is None for m in on_host.experts)
    a, b = draft_buffers(on_module), draft_buffers(on_host)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gptq_needs_calibration():
    with pytest.raises(SpecterError):
        quantize_experts_gptq(fresh(), [])
