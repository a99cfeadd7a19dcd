"""The residual store's build works within a bound in bytes, whatever the expert size: several experts per
encode where they are small, a slice of one expert's rows at a time where one linear alone is larger; the
blobs are the same either way."""
import pytest
import torch

import specter
import specter.offload.residual_store as residual_store
from specter.offload.residual_store import ENCODE_BYTES_PER_WEIGHT, ResidualExpertStore, encode_chunk
from specter.quant.int4 import quantize_rtn, unpack_codes
from specter.quant.residual import encode
from specter.quant.residual_expert import encode_in_rows, scales_by_row
from specter.offload.runtime import move_experts_to_store
from tests.live_bytes import LiveBytes


def linear(n: int = 1, out: int = 96, inp: int = 256, seed: int = 0):
    torch.manual_seed(seed)
    weight = (torch.randn(n, out, inp) * 0.02).bfloat16()
    return weight, quantize_rtn(weight)


@pytest.mark.parametrize("max_weights", [256, 1000, 96 * 256 // 3, None])
def test_a_linear_encoded_in_slices_of_rows_is_the_same_encoding(max_weights):
    weight, draft = linear()
    whole = encode(weight, unpack_codes(draft.qweight), scales_by_row(draft), draft.group_size)
    sliced = encode_in_rows(weight, draft, max_weights)
    for field in ("margin_class", "zero_width", "word_start", "words"):
        assert torch.equal(getattr(whole, field), getattr(sliced, field)), field


def test_the_encodes_temporaries_per_weight_are_what_the_bound_assumes():
    weight, draft = linear(out=256, inp=512)
    codes, scales = unpack_codes(draft.qweight), scales_by_row(draft)
    with LiveBytes() as live:
        encode(weight, codes, scales, draft.group_size)
    assert live.peak <= ENCODE_BYTES_PER_WEIGHT * weight.numel() * 1.05
    assert live.peak >= ENCODE_BYTES_PER_WEIGHT * weight.numel() * 0.8  # the constant is not loose either


def test_chunks_are_sized_by_bytes():
    experts, weights = encode_chunk(8, 4096, 1408, 4 * 2**30)  # dsv2-like
    assert experts * 2 * 1408 * 4096 * ENCODE_BYTES_PER_WEIGHT <= 4 * 2**30 and experts >= 1
    experts, weights = encode_chunk(8, 4096, 14336, 4 * 2**30)  # mixtral-like
    assert experts == 1 and weights * ENCODE_BYTES_PER_WEIGHT <= 4 * 2**30 < 2 * 14336 * 4096 * 96  # rows sliced


def test_the_build_stays_within_its_bound_and_gives_the_unbounded_blobs(monkeypatch):
    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.bfloat16)
    store = move_experts_to_store(model, keep_on_device=True)
    reference = ResidualExpertStore.build(store, model.experts)
    largest = 2 * store.intermediate * store.hidden * ENCODE_BYTES_PER_WEIGHT  # one expert's gate_up encode
    bound = largest // 3  # below one expert: slices of rows
    monkeypatch.setattr(residual_store, "ENCODE_WORK_BYTES", bound)
    with LiveBytes() as live:
        bounded = ResidualExpertStore.build(store, model.experts)
    layer_raw = store.num_experts * 3 * store.intermediate * store.hidden * 2  # layer_weights' host copy
    blobs = reference.total_bytes + 2 * max(buffer.numel() * 4 for buffer in reference.buffers)  # kept + joining
    assert live.peak <= bound * 1.1 + layer_raw + blobs  # unbounded, the encode alone is 3x the bound
    assert all(torch.equal(a, b) for a, b in zip(reference.buffers, bounded.buffers))
