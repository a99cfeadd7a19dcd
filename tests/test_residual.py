"""Residual transfer: the 16-bit weights rebuilt from INT4 codes + residuals equal the originals bit for bit."""
import pytest
import torch

from specter.quant.gptq import gptq_quantize
from specter.quant.int4 import GROUP_SIZE, quantize_to_codes, symmetric_scales, unpack_codes
from specter.quant.residual import (
    MARGINS,
    RAW_CLASS,
    bits_of,
    choose_classes,
    class_margins,
    decode,
    encode,
    fold_residuals,
    intervals,
    keys_to_bits,
    mean_bits,
    order_keys,
    truncated_bits,
)
from tests.scripts import load_script

DTYPES = [torch.float16, torch.bfloat16]


def rtn_round_trip(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    scales = symmetric_scales(weight, group_size).to(weight.dtype)  # [..., out, in/g], as stored
    codes = quantize_to_codes(weight, symmetric_scales(weight, group_size), group_size)
    encoded = encode(weight, codes, scales, group_size)
    return encoded, decode(encoded, codes, scales)


def assert_bit_exact(rebuilt: torch.Tensor, weight: torch.Tensor) -> None:
    assert rebuilt.dtype == weight.dtype and rebuilt.shape == weight.shape
    assert torch.equal(bits_of(rebuilt), bits_of(weight))


def test_order_keys_are_monotone_and_invertible():
    every = torch.arange(65536, dtype=torch.int32)
    assert torch.equal(keys_to_bits(order_keys(every)), every)
    for dtype in DTYPES:
        values = torch.arange(65536, dtype=torch.int32)
        finite = ~torch.isnan(torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16).view(dtype))
        bits = values[finite]
        floats = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype).float()
        order = torch.argsort(order_keys(bits))
        assert (floats[order].diff() >= 0).all()  # non-decreasing; -0 and +0 are equal as floats


@pytest.mark.parametrize("dtype", DTYPES)
def test_integer_truncation_rounds_toward_zero(dtype):
    torch.manual_seed(4)
    x = torch.cat([torch.randn(20000) * s for s in (3e-8, 1e-6, 1e-5, 1e-4, 1e-2, 1.0, 1e2, 1e4, 6e4, 1e30)])
    nearest = x.to(dtype)
    overshoot = nearest.float().abs() > x.abs()
    expected = bits_of(nearest) - overshoot.to(torch.int32)  # one magnitude step toward zero
    finite = ~torch.isinf(nearest.float())
    assert torch.equal(truncated_bits(x, dtype)[finite], expected[finite])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", ["normal", "laplace"])
def test_random_experts_round_trip_and_shrink(dtype, dist):
    torch.manual_seed(0)
    shape = (3, 32, 512)  # [experts, out, in]
    sample = torch.randn(shape) if dist == "normal" else torch.distributions.Laplace(0.0, 1.0).sample(shape)
    weight = (0.02 * sample).to(dtype)
    encoded, rebuilt = rtn_round_trip(weight)
    assert_bit_exact(rebuilt, weight)
    assert not encoded.raw.any()
    limit = {(torch.float16, "normal"): 11.5, (torch.float16, "laplace"): 12.5,
             (torch.bfloat16, "normal"): 9.0, (torch.bfloat16, "laplace"): 10.5}[dtype, dist]
    assert mean_bits(encoded, weight.numel()) < limit  # 16 bits raw


@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_groups_round_trip(dtype):
    info = torch.finfo(dtype)
    torch.manual_seed(1)
    weight = (0.02 * torch.randn(8, 4 * GROUP_SIZE)).to(dtype)
    weight[0] = 0.0  # whole groups of zeros
    weight[1, ::2], weight[1, 1::2] = 0.0, -0.0  # +0 and -0 mixed
    weight[2] = (torch.randn(4 * GROUP_SIZE) * info.smallest_normal).to(dtype)  # subnormals
    weight[3, 0], weight[3, GROUP_SIZE], weight[3, 5] = info.max, -info.max, info.tiny  # the largest magnitudes
    weight[4, :GROUP_SIZE] = info.max * torch.sign(torch.randn(GROUP_SIZE)).to(dtype)
    weight[5, 3], weight[5, GROUP_SIZE + 1] = float("nan"), float("inf")  # no interval holds these: raw groups
    weight[6, :GROUP_SIZE] = 1e-3 * weight[6, :GROUP_SIZE]  # one group much smaller than the row's others
    weight[7, 7] = 1.0  # an outlier in a group
    encoded, rebuilt = rtn_round_trip(weight)
    assert_bit_exact(rebuilt, weight)
    assert encoded.raw[5, 0] and encoded.raw[5, 1] and not encoded.raw[7].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_point_weights_take_the_fewest_bits_that_hold_their_group(dtype):
    """A group's zero width is the narrowest fold of its zero-point interval that holds its zero-point weights: their
    magnitudes' top keys (both signs); one weight near zero (or a zero) widens only its own group."""
    torch.manual_seed(5)
    weight = (0.02 * torch.randn(4, 3 * GROUP_SIZE)).to(dtype)
    codes = quantize_to_codes(weight, symmetric_scales(weight))
    zero_point = codes == 8
    group = weight[1, :GROUP_SIZE]
    weight[1, :GROUP_SIZE] = torch.where(zero_point[1, :GROUP_SIZE], 1e-3 * group, group)
    first = zero_point[2].nonzero()[0, 0]
    weight[2, first] = -0.0  # a zero-point weight that is zero: the whole interval
    weight[3, zero_point[3]] = -weight[3, zero_point[3]]  # signs flipped: the same magnitudes, the same width
    codes = quantize_to_codes(weight, symmetric_scales(weight))
    scales = symmetric_scales(weight).to(dtype)
    encoded = encode(weight, codes, scales, GROUP_SIZE)
    assert_bit_exact(decode(encoded, codes, scales), weight)
    keys = order_keys(bits_of(weight))
    full_widths = intervals(codes, scales, dtype, GROUP_SIZE, class_margins(encoded.margin_class))[1]
    full = full_widths[codes == 8].max().item()
    assert encoded.zero_width[2, first // GROUP_SIZE] == full and (encoded.zero_width <= full).all()
    saving = 5 if dtype == torch.bfloat16 else 1000  # bf16: zero-point weights in their top binades; fp16: little
    if dtype == torch.bfloat16:
        assert (encoded.zero_width[0] < full - 2).all()
        assert encoded.zero_width[1, 0] > encoded.zero_width[0].max()  # its zero-point weights 1000x smaller
    narrower = (encoded.zero_width.to(torch.int32) - 1).clamp_min(0)
    held = fold_residuals(keys, *intervals(codes, scales, dtype, GROUP_SIZE, class_margins(encoded.margin_class),
                                           narrower))[1]
    zero_groups = (codes == 8).unflatten(-1, (-1, GROUP_SIZE)).any(-1)
    assert not (held.unflatten(-1, (-1, GROUP_SIZE)).all(-1) & zero_groups).any()  # one bit fewer holds none
    used = intervals(codes, scales, dtype, GROUP_SIZE, class_margins(encoded.margin_class), encoded.zero_width)[1]
    zero_bits_unfolded = full_widths[codes == 8].sum().item()
    assert used.sum().item() <= full_widths.sum().item() - zero_bits_unfolded / saving  # the stream's bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_gptq_codes_round_trip_with_wider_margins(dtype):
    torch.manual_seed(2)
    weight = (0.02 * torch.randn(2, 16, 256)).to(dtype)
    inputs = torch.randn(2, 512, 256)
    packed = gptq_quantize(weight, inputs.transpose(-1, -2) @ inputs)
    codes, scales = unpack_codes(packed.qweight), packed.scales.transpose(-1, -2)  # [.., out, in], [.., out, in/g]
    per_weight = scales.float().repeat_interleave(GROUP_SIZE, -1)
    assert ((weight.float() / per_weight - (codes.float() - 8)).abs() > 0.52).any()  # GPTQ moves past 1/2
    encoded = encode(weight, codes, scales, GROUP_SIZE)
    assert_bit_exact(decode(encoded, codes, scales), weight)
    assert not encoded.raw.any() and (encoded.margin_class > 0).all()
    assert mean_bits(encoded, weight.numel()) < (13.5 if dtype == torch.float16 else 12.0)


def test_arbitrary_codes_still_round_trip():
    torch.manual_seed(3)
    weight = torch.randn(4, 256).to(torch.float16)
    scales = symmetric_scales(weight).to(torch.float16)
    codes = torch.randint(0, 16, weight.shape, dtype=torch.uint8)  # codes of some other tensor
    encoded = encode(weight, codes, scales, GROUP_SIZE)
    assert encoded.raw.all()
    assert_bit_exact(decode(encoded, codes, scales), weight)


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="16-bit float"):
        rtn_round_trip(torch.randn(2, GROUP_SIZE))


def test_the_bits_script_measures_a_tiny_expert(monkeypatch):
    script = load_script("residual_bits")
    assert script.expert_shapes("dsv2") == [(1408, 2048), (1408, 2048), (2048, 1408)]
    monkeypatch.setattr(script, "expert_shapes", lambda name: [(8, 256), (256, 128)])
    row = script.measure("dsv2", torch.bfloat16, "laplace", "gptq")
    assert 0.5 < row["sent_over_raw"] < 1.0 and row["margin_class_shares"].count(" ") == len(MARGINS)
    rtn = script.measure("dsv2", torch.bfloat16, "normal", "rtn")
    assert rtn["margin_class_shares"].startswith("1.000")
    zero_fixed, zero_ideal = map(float, rtn["zero_code_bits"].split())
    assert 0.05 < rtn["zero_code_share"] < 0.3 and zero_ideal < zero_fixed < 12.5  # folded: 15 bits unfolded
    total_saving = rtn["stream_bits_per_weight"] - rtn["entropy_bits_per_weight"]
    parts = rtn["zero_code_saving_bits_per_weight"] + rtn["other_saving_bits_per_weight"]
    assert parts >= total_saving - 0.01  # split buckets fit at least as well
    for top in script.HUFFMAN_TOP_BITS:  # a real code spends at least the entropy of what it codes
        assert rtn[f"huffman_top{top}_saving_of_sent"] <= rtn["entropy_saving_of_sent"] + 1e-4


def test_huffman_lengths_are_optimal_and_prefix_free():
    script = load_script("residual_bits")
    assert script.huffman_lengths([1, 1, 2, 0]) == {0: 2, 1: 2, 2: 1}
    assert script.huffman_lengths([0, 5]) == {1: 1}
    lengths = script.huffman_lengths([1, 2, 4, 8, 16, 32])
    assert sum(2.0 ** -n for n in lengths.values()) == 1.0 and lengths[5] == 1 and lengths[0] == 5


def test_bit_length_is_exact_for_every_span():
    from specter.quant.residual import bit_length
    spans = torch.arange(1 << 17, dtype=torch.int32)
    assert bit_length(spans).tolist() == [int(s).bit_length() for s in range(1 << 17)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_classes_tried_on_open_groups_only_equal_every_class_tried_on_every_group(dtype):
    """choose_classes tries a wider class only on the groups the narrower ones did not hold; the result is the
    definition's: the smallest class that holds every weight of the group, and its intervals."""
    torch.manual_seed(3)
    w = (torch.randn(2, 8, 4 * GROUP_SIZE) * 0.02).to(dtype)
    w[0, 1, :3] = float("nan")  # a group no class holds
    codes = quantize_to_codes(w, symmetric_scales(w))
    for rows, step in ((slice(2, 4), 1), (slice(4, 6), 2)):  # codes one and two off in some groups: wider classes
        part = codes[1, rows]
        codes[1, rows] = torch.where(torch.rand(part.shape) < 0.03, (part.int() + step).clamp(0, 15), part.int()).to(
            torch.uint8)
    scales = symmetric_scales(w).to(dtype)
    keys = order_keys(bits_of(w))
    chosen, low, width, fold = choose_classes(keys, codes, scales, dtype, GROUP_SIZE)
    expected = torch.full(scales.shape, RAW_CLASS, dtype=torch.uint8)
    for index in reversed(range(len(MARGINS))):  # every class on every group, the narrowest holding one wins
        interval = intervals(codes, scales, dtype, GROUP_SIZE, torch.full(scales.shape, MARGINS[index]))
        inside = fold_residuals(keys, *interval)[1]
        expected[inside.unflatten(-1, (-1, GROUP_SIZE)).all(-1)] = index
    assert torch.equal(chosen, expected) and set(expected.unique().tolist()) >= {0, 1, 2, RAW_CLASS}
    held = (chosen != RAW_CLASS).repeat_interleave(GROUP_SIZE, dim=-1)
    lows, widths, folds = intervals(codes, scales, dtype, GROUP_SIZE, class_margins(chosen))
    assert torch.equal(fold[held], folds[held])
    assert torch.equal(low[held], lows[held]) and torch.equal(width[held], widths[held])
